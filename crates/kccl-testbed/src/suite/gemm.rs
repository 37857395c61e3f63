//! agg-gemm: reduce then C = reduced matrix x B at the root (the paper's GEMM workload).

use super::*;

/// C = A x B for n x n row-major matrices (i-k-j order, vectorizable).
pub(super) fn gemm(a: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0f32; n * n];
    for i in 0..n {
        let ci = &mut c[i * n..(i + 1) * n];
        for k in 0..n {
            let aik = a[i * n + k];
            let bk = &b[k * n..(k + 1) * n];
            for (cv, bv) in ci.iter_mut().zip(bk) {
                *cv += aik * bv;
            }
        }
    }
    c
}

/// The f64 reference of [`gemm`]: the product and, per entry, the sum of the
/// magnitudes of its terms (what the float32 rounding error is bounded by).
pub(super) fn gemm_f64(a: &[f64], b: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut c, mut mag) = (vec![0f64; n * n], vec![0f64; n * n]);
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            let bk = &b[k * n..(k + 1) * n];
            let (ci, mi) = (&mut c[i * n..(i + 1) * n], &mut mag[i * n..(i + 1) * n]);
            for ((cv, mv), &bv) in ci.iter_mut().zip(mi.iter_mut()).zip(bk) {
                let p = aik * f64::from(bv);
                *cv += p;
                *mv += p.abs();
            }
        }
    }
    (c, mag)
}

/// Checks every entry of a float32 product of n-term dot products against
/// the f64 reference: a sum of n float32 terms accumulated in order is off
/// by at most gamma_n * sum|terms|, gamma_n = n u / (1 - n u), u = 2^-24
/// (the products of these integer-valued matrices are exact in float32).
pub(super) fn check_gemm(c: &[f32], want: &[f64], mag: &[f64], n: usize) -> Result<()> {
    let nu = n as f64 * f64::from(f32::EPSILON) / 2.0;
    let gamma = nu / (1.0 - nu);
    if c.len() != want.len() {
        return Err(Error::wrong("GEMM", format!("{} entries, expected {}", c.len(), want.len())));
    }
    for (idx, ((&got, &w), &m)) in c.iter().zip(want).zip(mag).enumerate() {
        let tol = gamma * m + m * 1e-12;
        if (f64::from(got) - w).abs() > tol || got.is_nan() {
            return Err(Error::wrong(
                "GEMM",
                format!("C[{}][{}] = {got}, expected {w} within {tol:.3e}", idx / n, idx % n),
            ));
        }
    }
    Ok(())
}

pub(super) fn agg_gemm(spec: &SuiteSpec, env: &Env, prog: &ExperimentProgress<'_>) -> ExperimentResult {
    let e = Experiment::AggGemm;
    let mut res = ExperimentResult::new(
        e,
        spec,
        env,
        "reduce of N x N int32 matrices and the root's float32 GEMM of the result, one timed operation",
        "ms",
        "matrix size N",
        true,
    );
    let ns: Vec<usize> = if spec.smoke { vec![64, 128] } else { vec![128, 256, 512, 1024] };
    res.notes.push(format!(
        "kccl: each timed operation runs from the barrier all ranks leave together (every rank's first send) to the root \
         holding C = float32(reduced matrix) x B (single-threaded i-k-j GEMM, B a fixed N x N matrix), as in the paper's \
         figure 8; median/p99 are those of these per-operation totals; before timing, each path's checked operation compares \
         the reduced matrix element by element and every entry of C with an f64 reference (float32 bound n 2^-24 sum|a b|); \
         `gemm-only` = the median time of the GEMM inside the timed operations (both paths); peers ({} run(s)): their \
         timed reduce + that GEMM median, since the peers' scripts do not multiply (not one timed operation)",
        peer_runs(spec, PEER_RUNS)
    ));
    let mut acc = Acc::default();
    let c = match AggCluster::up(spec, e, "su-gm", SENDERS, prog, "") {
        Ok(c) => c,
        Err(err) => {
            res.errors.push(format!("building the cluster: {err}"));
            return res;
        }
    };
    let contributors: Vec<u16> = (0..=SENDERS as u16).collect();
    // The reduce grows with N^2, the GEMM and its reference with N^3.
    prog.plan(
        &ns.iter()
            .map(|&n| if n * n * 4 <= spec.max_bytes { (n * n * (n + 64)) as u64 } else { 0 })
            .collect::<Vec<_>>(),
    );
    for &n in &ns {
        let point = format!("N={n}");
        prog.point(&point);
        let bytes = n * n * 4;
        if bytes > spec.max_bytes {
            res.skipped.push(format!("{point}: {bytes} B per rank above --max-bytes {}", spec.max_bytes));
            continue;
        }
        prog.say(format!("{point}: f64 reference of the GEMM on the reduced matrix"));
        let sum: Vec<f64> =
            (0..n * n).map(|i| f64::from(contributors.iter().map(|&r| rank_value(r, i)).sum::<i32>())).collect();
        let b: Vec<f32> = (0..n * n).map(|i| rank_value(0, i) as f32).collect();
        let (want, mag) = gemm_f64(&sum, &b, n);
        let work = |r: &[i32], check: bool| -> Result<()> {
            let a: Vec<f32> = r.iter().map(|&v| v as f32).collect();
            let c = gemm(&a, &b, n);
            if check {
                check_gemm(&c, &want, &mag, n)?;
            }
            std::hint::black_box(&c);
            Ok(())
        };
        let recs = kccl_reduce_repeats(spec, &c.h, &mut res, &mut acc, prog, &point, n as f64, bytes, Some(&work));
        let mut g: Vec<f64> = recs.iter().filter_map(|r| r.root_work_p50_ms).collect();
        g.sort_by(f64::total_cmp);
        if g.is_empty() {
            continue;
        }
        let g50 = percentile(&g, 50.0);
        prog.say(format!("  GEMM {n}x{n} inside the timed reduce: median {g50:.2} ms"));
        let mut gs = Sample::new(g50, f64::NAN);
        gs.iters = recs.iter().map(|r| r.iters).sum();
        acc.add("", n as f64, &point, "gemm-only", gs);
        let pp = reduce_peer_point(bytes, (3, 20), n as f64, &point, g50);
        c.run_peers(spec, &mut res, &mut acc, prog, &pp);
    }
    drop(c);
    res.rows = acc.rows();
    res
}
