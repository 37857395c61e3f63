//! The demo's verdict: one line per collective and path saying whether every
//! result was exact (each run checks its results against a reference computed
//! locally before anything is timed), how long one operation took and how the
//! kernel path compares with the user path in words; then one sentence on
//! whether kccl works on this machine.  A newcomer reads this block, not the
//! rows of figures above it.

use kccl::transport::Path;

use crate::error::Error;

/// How one collective did on one path.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Every result matched the reference; `ms` is the median time of one
    /// operation of the timed point named by `point`.
    Exact { ms: f64, point: String },
    /// A result differed from the reference.
    Wrong(String),
    /// The run stopped before its results could be checked.
    Failed(String),
    /// Not run on this machine, and why.
    NotRun(String),
}

impl Outcome {
    /// The outcome of a run: a failed result check is `Wrong`, any other
    /// error `Failed`.
    pub fn of(r: Result<(f64, String), Error>) -> Outcome {
        match r {
            Ok((ms, point)) => Outcome::Exact { ms, point },
            Err(e @ Error::Testbed(kccl_testbed::Error::WrongResult { .. })) => Outcome::Wrong(e.to_string()),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }

    fn is_bad(&self) -> bool {
        matches!(self, Outcome::Wrong(_) | Outcome::Failed(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    Broadcast,
    Reduce,
    Allreduce,
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Allreduce => "allreduce",
        }
    }

    /// The command that shows this collective in detail on a virtual cluster.
    fn closer_look(self) -> &'static str {
        match self {
            Collective::Broadcast => "sudo target/release/kccl bench broadcast --smoke",
            Collective::Reduce => "sudo target/release/kccl bench reduce --smoke",
            Collective::Allreduce => "sudo target/release/kccl bench allreduce --smoke",
        }
    }
}

#[derive(Debug, Default)]
pub struct Verdict {
    lines: Vec<(Collective, Path, Outcome)>,
    /// Why only the user path ran (not root, no BPF), if so.
    user_only: Option<String>,
}

impl Verdict {
    /// Marks the run as user path only, and why (the first reason given stays).
    pub fn user_only(&mut self, why: String) {
        self.user_only.get_or_insert(why);
    }

    pub fn user_only_reason(&self) -> Option<&str> {
        self.user_only.as_deref()
    }

    pub fn runs(&self) -> usize {
        self.lines.iter().filter(|(_, _, o)| !matches!(o, Outcome::NotRun(_))).count()
    }

    pub fn record(&mut self, c: Collective, p: Path, o: Outcome) {
        self.lines.push((c, p, o));
    }

    fn get(&self, c: Collective, p: Path) -> Option<&Outcome> {
        self.lines.iter().find(|(lc, lp, _)| *lc == c && *lp == p).map(|(_, _, o)| o)
    }

    /// Results that were wrong or runs that failed.
    pub fn bad(&self) -> usize {
        self.lines.iter().filter(|(_, _, o)| o.is_bad()).count()
    }

    /// The verdict block, ending with the closing sentence.
    pub fn render(&self) -> String {
        let mut out = String::from("== verdict (every result checked against a reference computed locally)\n");
        for (c, p, o) in &self.lines {
            let what = match o {
                Outcome::Exact { ms, point } => {
                    let mut s = format!("exact  {}  {point}", fmt_ms(*ms));
                    if *p == Path::Kernel {
                        if let Some(Outcome::Exact { ms: user, .. }) = self.get(*c, Path::User) {
                            s += &format!("; {}", ratio_words(*ms, *user));
                        }
                    }
                    s
                }
                Outcome::Wrong(e) => format!("WRONG  {e}"),
                Outcome::Failed(e) => format!("FAILED {e}"),
                Outcome::NotRun(why) => format!("not run: {why}"),
            };
            out += &format!("  {:<9} {:<6} path  {what}\n", c.name(), p.to_string());
        }
        out += &self.closing();
        out.push('\n');
        out
    }

    fn closing(&self) -> String {
        let bad: Vec<&(Collective, Path, Outcome)> = self.lines.iter().filter(|(_, _, o)| o.is_bad()).collect();
        if let Some((c, p, _)) = bad.first() {
            let which: Vec<String> = bad.iter().map(|(c, p, _)| format!("{} on the {p} path", c.name())).collect();
            return format!(
                "kccl did NOT work on this machine: {} of {} runs gave a wrong result or failed ({}). \
                 Look closer at the first one ({} on the {p} path) with `{}`.",
                bad.len(),
                self.lines.len(),
                which.join(", "),
                c.name(),
                c.closer_look()
            );
        }
        match &self.user_only {
            Some(why) => format!(
                "kccl's user-space path works on this machine: every result was exact. Only the user path ran: {why}."
            ),
            None => "kccl works on this machine: broadcast, reduce and allreduce gave exact results on the kernel \
                     path and on the user path."
                .to_string(),
        }
    }
}

/// The kernel path's time relative to the user path's, in words.
pub fn ratio_words(kernel_ms: f64, user_ms: f64) -> String {
    if !(kernel_ms > 0.0 && user_ms > 0.0) {
        return "no ratio (a time of zero)".to_string();
    }
    let r = user_ms / kernel_ms;
    if (r - 1.0).abs() < 0.05 {
        "kernel path as fast as the user path".to_string()
    } else if r > 1.0 {
        format!("kernel path {r:.1}x faster than the user path")
    } else {
        format!("kernel path {:.1}x slower than the user path", 1.0 / r)
    }
}

fn fmt_ms(ms: f64) -> String {
    if ms < 1.0 {
        format!("{:>7.1} us", ms * 1e3)
    } else {
        format!("{ms:>7.2} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(ms: f64) -> Outcome {
        Outcome::Exact { ms, point: "4194304 B".into() }
    }

    #[test]
    fn ratios_in_words() {
        assert_eq!(ratio_words(1.0, 2.1), "kernel path 2.1x faster than the user path");
        assert_eq!(ratio_words(3.0, 1.0), "kernel path 3.0x slower than the user path");
        assert_eq!(ratio_words(1.0, 1.02), "kernel path as fast as the user path");
        assert_eq!(ratio_words(0.0, 1.0), "no ratio (a time of zero)");
    }

    #[test]
    fn all_exact_says_kccl_works() {
        let mut v = Verdict::default();
        for c in [Collective::Broadcast, Collective::Reduce, Collective::Allreduce] {
            v.record(c, Path::Kernel, exact(1.0));
            v.record(c, Path::User, exact(2.0));
        }
        let s = v.render();
        assert_eq!(v.bad(), 0);
        assert_eq!(s.matches("kernel path 2.0x faster than the user path").count(), 3, "{s}");
        assert!(s.contains("  reduce    kernel path  exact     1.00 ms  4194304 B;"), "{s}");
        assert!(s.trim_end().ends_with("on the kernel path and on the user path."), "{s}");
    }

    #[test]
    fn user_only_says_why_and_still_succeeds() {
        let mut v = Verdict::default();
        v.user_only("not root".into());
        v.record(Collective::Broadcast, Path::Kernel, Outcome::NotRun("not root".into()));
        v.record(Collective::Broadcast, Path::User, exact(0.05));
        let s = v.render();
        assert_eq!(v.bad(), 0);
        assert!(s.contains("broadcast kernel path  not run: not root"), "{s}");
        assert!(s.contains("exact     50.0 us"), "{s}");
        assert!(s.contains("Only the user path ran: not root."), "{s}");
        assert!(!s.contains("faster"), "{s}");
    }

    #[test]
    fn a_wrong_result_names_it_and_the_command_to_look_closer() {
        let mut v = Verdict::default();
        v.record(Collective::Reduce, Path::Kernel, exact(1.0));
        let wrong = Err(Error::Testbed(kccl_testbed::Error::wrong("reduce", "element 3 is 7, want 8")));
        v.record(Collective::Reduce, Path::User, Outcome::of(wrong));
        let s = v.render();
        assert_eq!(v.bad(), 1);
        assert!(s.contains("reduce    user   path  WRONG  reduce check: element 3 is 7, want 8"), "{s}");
        assert!(s.contains("kccl did NOT work on this machine: 1 of 2 runs"), "{s}");
        assert!(s.contains("`sudo target/release/kccl bench reduce --smoke`"), "{s}");
        assert!(!s.contains("faster"), "no ratio against a wrong result: {s}");
    }
}
