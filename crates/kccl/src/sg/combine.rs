//! What a scatter-gather request does with its replies: a built-in combine
//! over the replies' elements (SUM, MIN, MAX, COUNT of big-endian int32 or
//! int64, as the aggregation wire carries them), or CONCAT, the replies
//! gathered side by side, in rank order, uncombined.
//!
//! Replies of different lengths combine element by element over the longest
//! one: an element only some replies have is combined over those (SUM and
//! COUNT as if the others held 0). Sums are exact: int32 elements add in
//! int64, int64 elements with overflow checks, and a result that does not fit
//! its type is an error naming the element, never a wrapped value.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::wire::{DT_BYTES, DT_I32, DT_I64, OP_CONCAT, OP_COUNT, OP_MAX, OP_MIN, OP_SUM};

/// How the replies of one request become its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    Sum,
    Min,
    Max,
    /// Per element: how many replies hold a non-zero value there.
    Count,
    /// No combining: every reply, by rank.
    Concat,
}

impl Combine {
    /// enum kccl_agg_op value in the request header.
    pub fn wire(self) -> u8 {
        match self {
            Combine::Sum => OP_SUM,
            Combine::Min => OP_MIN,
            Combine::Max => OP_MAX,
            Combine::Count => OP_COUNT,
            Combine::Concat => OP_CONCAT,
        }
    }

    pub fn from_wire(op: u8) -> Option<Combine> {
        [Combine::Sum, Combine::Min, Combine::Max, Combine::Count, Combine::Concat].into_iter().find(|c| c.wire() == op)
    }
}

impl FromStr for Combine {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sum" => Ok(Combine::Sum),
            "min" => Ok(Combine::Min),
            "max" => Ok(Combine::Max),
            "count" => Ok(Combine::Count),
            "concat" => Ok(Combine::Concat),
            _ => Err(Error::Usage(format!("unknown combine '{s}': use sum, min, max, count or concat"))),
        }
    }
}

impl fmt::Display for Combine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Combine::Sum => "sum",
            Combine::Min => "min",
            Combine::Max => "max",
            Combine::Count => "count",
            Combine::Concat => "concat",
        })
    }
}

/// The element type of the replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// Opaque bytes: only [`Combine::Concat`] applies.
    Bytes,
    I32,
    I64,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::Bytes => 1,
            Elem::I32 => 4,
            Elem::I64 => 8,
        }
    }

    /// enum kccl_dtype value in the request header.
    pub fn wire(self) -> u8 {
        match self {
            Elem::Bytes => DT_BYTES,
            Elem::I32 => DT_I32,
            Elem::I64 => DT_I64,
        }
    }

    pub fn from_wire(dt: u8) -> Option<Elem> {
        [Elem::Bytes, Elem::I32, Elem::I64].into_iter().find(|e| e.wire() == dt)
    }
}

impl FromStr for Elem {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bytes" => Ok(Elem::Bytes),
            "i32" => Ok(Elem::I32),
            "i64" => Ok(Elem::I64),
            _ => Err(Error::Usage(format!("unknown element type '{s}': use bytes, i32 or i64"))),
        }
    }
}

impl fmt::Display for Elem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Elem::Bytes => "bytes",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
        })
    }
}

/// A combine that applies to an element type, or why not.
pub fn check(combine: Combine, elem: Elem) -> Result<()> {
    if elem == Elem::Bytes && combine != Combine::Concat {
        return Err(Error::Usage(format!(
            "combine {combine} needs int32 or int64 replies (element type bytes: use concat)"
        )));
    }
    Ok(())
}

/// The result of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    I32(Vec<i32>),
    I64(Vec<i64>),
    /// [`Combine::Concat`]: each combined worker's reply, by rank.
    Replies(Vec<(u16, Vec<u8>)>),
}

/// Replies encoded as workers send them (big-endian elements).
pub fn encode_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_be_bytes()).collect()
}

pub fn encode_i64(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_be_bytes()).collect()
}

/// The combined value of one request so far.
pub(crate) struct Acc {
    combine: Combine,
    elem: Elem,
    vals: Vec<i64>,
    /// First element whose int64 sum overflowed.
    overflow: Option<usize>,
    replies: Vec<(u16, Vec<u8>)>,
}

impl Acc {
    pub(crate) fn new(combine: Combine, elem: Elem) -> Acc {
        Acc { combine, elem, vals: Vec::new(), overflow: None, replies: Vec::new() }
    }

    /// The value the kernel combined (xdp_sg: int64 accumulators and the
    /// first element whose sum overflowed), finished as one combined here.
    pub(crate) fn from_kernel(combine: Combine, elem: Elem, vals: Vec<i64>, overflow: Option<usize>) -> Acc {
        Acc { combine, elem, vals, overflow, replies: Vec::new() }
    }

    /// Adds worker `rank`'s whole reply; Err says why it cannot be combined
    /// (the reply is then left out).
    pub(crate) fn add(&mut self, rank: u16, reply: Vec<u8>) -> std::result::Result<(), String> {
        let size = self.elem.size();
        if reply.len() % size != 0 {
            return Err(format!("a reply of {} bytes is not a whole number of {} elements", reply.len(), self.elem));
        }
        if self.combine == Combine::Concat {
            let at = self.replies.partition_point(|(r, _)| *r < rank);
            self.replies.insert(at, (rank, reply));
            return Ok(());
        }
        let n = reply.len() / size;
        let old = self.vals.len();
        if n > old {
            // Elements no earlier reply had: this reply's value is the first.
            self.vals.resize(n, 0);
        }
        let fresh = |i: usize| i >= old;
        let mut put = |i: usize, x: i64| {
            let v = &mut self.vals[i];
            match self.combine {
                Combine::Sum => match v.checked_add(x) {
                    Some(s) => *v = s,
                    None => {
                        self.overflow.get_or_insert(i);
                    }
                },
                Combine::Min => *v = if fresh(i) { x } else { (*v).min(x) },
                Combine::Max => *v = if fresh(i) { x } else { (*v).max(x) },
                Combine::Count => *v += i64::from(x != 0),
                Combine::Concat => unreachable!("handled above"),
            }
        };
        match self.elem {
            Elem::I32 => {
                for (i, b) in reply.chunks_exact(4).enumerate() {
                    put(i, i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]])));
                }
            }
            Elem::I64 => {
                for (i, b) in reply.chunks_exact(8).enumerate() {
                    put(i, i64::from_be_bytes(b.try_into().expect("chunks of 8")));
                }
            }
            Elem::Bytes => unreachable!("check() allows bytes only with concat"),
        }
        Ok(())
    }

    /// The result; `what` names the request in an overflow error.
    pub(crate) fn finish(self, what: &str) -> Result<Value> {
        let overflow = |i: usize, detail: String| Error::Overflow {
            what: what.to_owned(),
            detail: format!("element {i}: {detail}; the exact result does not fit the replies' element type"),
        };
        if let Some(i) = self.overflow {
            return Err(overflow(i, "the sum exceeds int64".into()));
        }
        match (self.combine, self.elem) {
            (Combine::Concat, _) => Ok(Value::Replies(self.replies)),
            (_, Elem::I64) => Ok(Value::I64(self.vals)),
            (_, _) => {
                let mut out = Vec::with_capacity(self.vals.len());
                for (i, &v) in self.vals.iter().enumerate() {
                    out.push(i32::try_from(v).map_err(|_| overflow(i, format!("{v} exceeds int32")))?);
                }
                Ok(Value::I32(out))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(combine: Combine, elem: Elem, replies: &[(u16, Vec<u8>)]) -> Result<Value> {
        let mut acc = Acc::new(combine, elem);
        for (r, b) in replies {
            acc.add(*r, b.clone()).map_err(Error::Usage)?;
        }
        acc.finish("request 7")
    }

    #[test]
    fn built_in_combines_over_int32() {
        let rs = [(1, encode_i32(&[3, -1, 0])), (2, encode_i32(&[5, -7, 2])), (3, encode_i32(&[-2, 4, 0]))];
        assert_eq!(run(Combine::Sum, Elem::I32, &rs).unwrap(), Value::I32(vec![6, -4, 2]));
        assert_eq!(run(Combine::Min, Elem::I32, &rs).unwrap(), Value::I32(vec![-2, -7, 0]));
        assert_eq!(run(Combine::Max, Elem::I32, &rs).unwrap(), Value::I32(vec![5, 4, 2]));
        assert_eq!(run(Combine::Count, Elem::I32, &rs).unwrap(), Value::I32(vec![3, 3, 1]));
    }

    #[test]
    fn replies_of_different_lengths_combine_over_the_longest() {
        // The longer reply comes second: its extra elements are its own (MIN
        // does not see a 0 there).
        let rs = [(4, encode_i64(&[10])), (2, encode_i64(&[3, 9, -5]))];
        assert_eq!(run(Combine::Min, Elem::I64, &rs).unwrap(), Value::I64(vec![3, 9, -5]));
        assert_eq!(run(Combine::Sum, Elem::I64, &rs).unwrap(), Value::I64(vec![13, 9, -5]));
        assert_eq!(run(Combine::Count, Elem::I64, &rs).unwrap(), Value::I64(vec![2, 1, 1]));
    }

    #[test]
    fn concat_keeps_replies_by_rank() {
        let rs = [(3, b"ccc".to_vec()), (1, b"a".to_vec()), (2, Vec::new())];
        assert_eq!(
            run(Combine::Concat, Elem::Bytes, &rs).unwrap(),
            Value::Replies(vec![(1, b"a".to_vec()), (2, Vec::new()), (3, b"ccc".to_vec())])
        );
    }

    #[test]
    fn sums_that_do_not_fit_are_errors_naming_the_element() {
        let rs = [(1, encode_i32(&[0, i32::MAX])), (2, encode_i32(&[0, 1]))];
        let e = run(Combine::Sum, Elem::I32, &rs).unwrap_err().to_string();
        assert!(e.contains("element 1") && e.contains("2147483648"), "{e}");
        let rs = [(1, encode_i64(&[i64::MAX])), (2, encode_i64(&[1]))];
        let e = run(Combine::Sum, Elem::I64, &rs).unwrap_err().to_string();
        assert!(e.contains("element 0") && e.contains("int64"), "{e}");
        // A sum that leaves int32 and comes back is exact, not an error.
        let rs = [(1, encode_i32(&[i32::MAX])), (2, encode_i32(&[1])), (3, encode_i32(&[-2]))];
        assert_eq!(run(Combine::Sum, Elem::I32, &rs).unwrap(), Value::I32(vec![i32::MAX - 1]));
    }

    #[test]
    fn a_ragged_reply_is_refused_and_left_out() {
        let mut acc = Acc::new(Combine::Sum, Elem::I32);
        acc.add(1, encode_i32(&[1, 2])).unwrap();
        let e = acc.add(2, vec![0; 7]).unwrap_err();
        assert!(e.contains("7 bytes") && e.contains("i32"), "{e}");
        assert_eq!(acc.finish("r").unwrap(), Value::I32(vec![1, 2]));
    }

    #[test]
    fn wire_values_round_trip_and_bytes_only_concat() {
        for c in [Combine::Sum, Combine::Min, Combine::Max, Combine::Count, Combine::Concat] {
            assert_eq!(Combine::from_wire(c.wire()), Some(c));
            assert_eq!(c.to_string().parse::<Combine>().unwrap(), c);
        }
        for e in [Elem::Bytes, Elem::I32, Elem::I64] {
            assert_eq!(Elem::from_wire(e.wire()), Some(e));
            assert_eq!(e.to_string().parse::<Elem>().unwrap(), e);
        }
        assert!(check(Combine::Sum, Elem::Bytes).is_err());
        assert!(check(Combine::Concat, Elem::Bytes).is_ok());
        assert!(check(Combine::Concat, Elem::I32).is_ok());
    }
}
