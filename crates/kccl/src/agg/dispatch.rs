//! One receive batch dispatched by role: contributions to the aggregator
//! backend, answers (ACK, ACKS, PENDING, RESULT) to the contributor.

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::transport::sock::{BatchSocket, RecvBatch};
use crate::wire::{Header, T_AGG, T_AGG_ABORT, T_AGG_ACK, T_AGG_ACKS, T_AGG_PENDING, T_AGG_RECEIPT, T_AGG_RESULT};

use super::backend::AggBackend;
use super::config::CollectiveStats;
use super::member::Contributor;
use super::user::AggSink;
use crate::transport::Path;

/// Where RESULT chunks go: (contributor, chunk, payload, overflow); the
/// contributor is the index into the slice of contributors pump drives.
pub(super) type Decode<'d> = &'d mut dyn FnMut(usize, usize, &[u8], bool);

/// Receives one batch (or times out) and hands every datagram to its role
/// (returns how many datagrams it received):
/// contributions to the aggregator backend, answers to the contributor
/// whose aggregator sent them (a sharded allreduce contributes to every
/// member at once, one contributor per aggregating rank).
#[allow(clippy::too_many_arguments)]
pub(super) fn pump(
    sock: &BatchSocket,
    rb: &mut RecvBatch,
    backend: &mut AggBackend,
    stats: &mut CollectiveStats,
    wait: Duration,
    root_waiting: bool,
    mut contrib: Option<(&mut [Contributor<'_>], Decode<'_>)>,
    sink: &mut dyn AggSink,
) -> Result<usize> {
    // Answers of this member's own xdp_agg runs already wait: no sleeping.
    let wait = if backend.own_inbox_waiting() { Duration::ZERO } else { wait };
    let mut sock_wait = wait;
    if backend.path() == Path::Kernel {
        // Kernel records: wait on the ring when the root waits for them,
        // else only drain it; then the socket without blocking.  No more
        // records than the sink can keep: the others stay in the ring (with
        // no room, the root waits on its socket only).  A sharded
        // allreduce's owner waits for its own records and its socket at
        // once (the ring's epoll set watches the socket too).
        let room = sink.room();
        let own = backend.own_shard_active();
        let ring_wait = (root_waiting || own) && room > 0;
        let t = match (ring_wait, own) {
            (false, _) => Duration::ZERO,
            (true, true) => wait,
            (true, false) => wait.min(Duration::from_millis(1)),
        };
        backend.poll(t, room, sink)?;
        sock_wait = if ring_wait { Duration::ZERO } else { wait };
    }
    let n = sock.recv_batch(rb, Some(sock_wait))?;
    stats.recv_calls += 1;
    let now = Instant::now();
    for i in 0..n {
        let (d, from) = rb.get(i);
        match d {
            Ok(d) => dispatch(d, from, now, backend, stats, &mut contrib, sink),
            Err(()) => stats.other_datagrams += 1,
        }
    }
    // What this member's own xdp_agg passed up (its own shard's answers
    // and records), as if its socket had received it.
    let mut own_n = 0;
    if let Some((inbox, me)) = backend.take_own_inbox() {
        own_n = inbox.len();
        for d in &inbox {
            dispatch(d, me, now, backend, stats, &mut contrib, sink);
        }
    }
    backend.sync_kernel()?;
    backend.user_mut().flush(sock)?;
    Ok(n + own_n)
}

/// One datagram to its role.
fn dispatch(
    d: &[u8],
    from: SocketAddrV4,
    now: Instant,
    backend: &mut AggBackend,
    stats: &mut CollectiveStats,
    contrib: &mut Option<(&mut [Contributor<'_>], Decode<'_>)>,
    sink: &mut dyn AggSink,
) {
    match Header::decode(d) {
        Ok((h, p)) if h.msg_type == T_AGG => {
            let agg = backend.user_mut();
            agg.count_datagram();
            agg.ingest(&h, p, from, now, sink);
        }
        Ok((h, _)) if h.msg_type == T_AGG_RECEIPT => backend.user_mut().take_receipt(&h, from),
        Ok((h, p)) if matches!(h.msg_type, T_AGG_RESULT | T_AGG_ACK | T_AGG_ACKS | T_AGG_PENDING) => {
            match contrib.as_mut() {
                Some((cs, dec)) if !cs.is_empty() => {
                    // An answer from no contributor's aggregator goes to
                    // the first, which counts it as bad.
                    let j = cs.iter().position(|c| c.spec().agg_rank == h.src_rank).unwrap_or(0);
                    cs[j].on_answer(&h, p, from, now, &mut |c, payload, ovf| dec(j, c, payload, ovf));
                }
                _ => stats.contrib.stale_answers += 1,
            }
        }
        // Another member ended the call: its contributor side or, on a
        // reduce root, the root's wait fails with the reason; an
        // aggregator frees the call's slots.
        Ok((h, p)) if h.msg_type == T_AGG_ABORT => {
            // One contributor takes it (a still running one, so that
            // its deadline check fails the call at once).
            match contrib.as_mut() {
                Some((cs, _)) if !cs.is_empty() => {
                    let j = cs.iter().position(|c| !c.done()).unwrap_or(0);
                    cs[j].on_abort(&h, p, from);
                }
                _ => sink.abort(&h, p, from),
            }
            backend.user_mut().take_abort(&h, p, from);
        }
        _ => stats.other_datagrams += 1,
    }
}
