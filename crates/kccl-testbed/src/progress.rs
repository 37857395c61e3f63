//! Where a long run is: `bench all`, `bench loss`, `bench peers` and the
//! bring-up of a large cluster report their progress on stderr.
//!
//! - stderr a terminal: an indicatif bar (`kccl bench all: experiment 3/7
//!   agg-throughput [=====>   ] 12:31 · ETA 03:20 · point 2/7 bytes=4194304`,
//!   total time elapsed, then the experiment's time left), redrawn every
//!   second so the clock moves during a point that takes minutes;
//! - stderr not a terminal (CI logs, `2>file`): plain lines instead, one per
//!   point (a stage's first always, then at most one every [`PLAIN_EVERY`]);
//! - `KCCL_PROGRESS=bar|plain|off` overrides the choice.
//!
//! A run is planned as stages (an experiment of the suite) made of points
//! with weights (their expected share of the stage's time, e.g. bytes), so
//! the ETA of a stage with a 1 MiB and a 512 MiB point is not an average of
//! the two. Results stay on stdout: [`Progress::say`] prints a line there
//! without tearing the bar.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// Plain mode: the least time between two progress lines of one run (the
/// first point of a stage and the end always print).
pub const PLAIN_EVERY: Duration = Duration::from_secs(2);

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Bar,
    Plain,
    Off,
}

impl Mode {
    /// `KCCL_PROGRESS` if set (bar, plain, off), else a bar when stderr is a terminal.
    pub fn from_env() -> Mode {
        match std::env::var("KCCL_PROGRESS").as_deref() {
            Ok("bar") => Mode::Bar,
            Ok("plain") => Mode::Plain,
            Ok("off") | Ok("0") => Mode::Off,
            _ if std::io::stderr().is_terminal() => Mode::Bar,
            _ => Mode::Plain,
        }
    }
}

/// Every bar of the process draws through this one, so a cluster bring-up
/// inside `bench all` shows as a second line instead of fighting the first.
fn multi() -> &'static MultiProgress {
    static M: OnceLock<MultiProgress> = OnceLock::new();
    M.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
}

/// Bars on screen now: while there is one, output goes through [`println`].
static BARS: AtomicUsize = AtomicUsize::new(0);

/// A line on stdout, drawn above any progress bar of the process (a plain
/// `println!` would tear the bar). The testbed's result lines use this
/// through [`crate::outln!`].
pub fn println(line: &str) {
    if BARS.load(Ordering::Relaxed) > 0 {
        multi().suspend(|| println!("{line}"));
    } else {
        println!("{line}");
    }
}

/// [`println`] for stderr ([`crate::errln!`]).
pub fn eprintln(line: &str) {
    if BARS.load(Ordering::Relaxed) > 0 {
        multi().suspend(|| eprintln!("{line}"));
    } else {
        eprintln!("{line}");
    }
}

/// `println!` that draws above any progress bar: see [`progress::println`](crate::progress::println).
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => { $crate::progress::println(&format!($($arg)*)) };
}

/// `eprintln!` that draws above any progress bar.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::progress::eprintln(&format!($($arg)*)) };
}

struct State {
    stage: String,
    stage_t0: Instant,
    weights: Vec<u64>,
    /// Number of points begun: the one under way is `weights[next - 1]`.
    next: usize,
    /// Weight done: that of the points before the current one, plus the
    /// share of it reported by [`Progress::fraction`].
    pos: u64,
    point: String,
    detail: String,
    last_plain: Option<Instant>,
}

/// The progress of one run; see the module comment. Dropping it clears its bar.
pub struct Progress {
    what: String,
    mode: Mode,
    bar: Option<ProgressBar>,
    t0: Instant,
    st: Mutex<State>,
}

impl Progress {
    /// Progress of `what` ("kccl bench all"), shown as [`Mode::from_env`] says.
    pub fn new(what: &str) -> Progress {
        Progress::with_mode(what, Mode::from_env())
    }

    /// A progress that shows nothing (library callers, small runs).
    pub fn hidden() -> Progress {
        Progress::with_mode("", Mode::Off)
    }

    pub fn with_mode(what: &str, mode: Mode) -> Progress {
        let t0 = Instant::now();
        let bar = (mode == Mode::Bar).then(|| {
            // The message goes last and is cut to the terminal's width, so the
            // bar stays one line.
            let style = ProgressStyle::with_template("{prefix} [{bar:20}] {total_elapsed} · ETA {left} · {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .with_key("total_elapsed", move |_: &ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = w.write_str(&clock(t0.elapsed()));
                })
                // No estimate before the first point is done (indicatif would say 0s).
                .with_key("left", |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = w.write_str(&if s.pos() == 0 { "?".to_owned() } else { clock(s.eta()) });
                })
                .progress_chars("=> ");
            let pb = multi().add(ProgressBar::new(1).with_style(style));
            pb.set_prefix(what.to_owned());
            pb.enable_steady_tick(Duration::from_secs(1));
            BARS.fetch_add(1, Ordering::Relaxed);
            pb
        });
        let st = State {
            stage: String::new(),
            stage_t0: t0,
            weights: Vec::new(),
            next: 0,
            pos: 0,
            point: String::new(),
            detail: String::new(),
            last_plain: None,
        };
        Progress { what: what.to_owned(), mode, bar, t0, st: Mutex::new(st) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new stage ("experiment 3/7 agg-throughput"): its points are planned
    /// with [`Progress::plan`].
    pub fn stage(&self, name: impl Into<String>) {
        let mut st = self.state();
        st.stage = name.into();
        st.stage_t0 = Instant::now();
        st.weights.clear();
        st.next = 0;
        st.pos = 0;
        st.point.clear();
        st.detail.clear();
        if let Some(pb) = &self.bar {
            pb.set_prefix(join(&self.what, &st.stage));
            // Empty until the stage's points are planned (a length 0 draws full).
            pb.set_length(1);
            pb.set_position(0);
            pb.reset_eta();
            pb.set_message(String::new());
        }
    }

    /// The points of the current stage, by weight (any unit: their expected
    /// share of its time). A zero weight is a point that takes no time (one
    /// skipped on this machine): it moves neither the bar nor the ETA, which
    /// would otherwise extrapolate a whole stage from it.
    pub fn plan(&self, weights: &[u64]) {
        let mut st = self.state();
        st.weights = weights.to_vec();
        st.next = 0;
        st.pos = 0;
        if let Some(pb) = &self.bar {
            // A length 0 draws full.
            pb.set_length(st.weights.iter().sum::<u64>().max(1));
            pb.set_position(0);
            pb.reset_eta();
        }
    }

    /// The next planned point begins (the previous one is done).
    pub fn point(&self, label: impl Into<String>) {
        let mut st = self.state();
        st.next += 1;
        st.pos = done_weight(&st);
        st.point = label.into();
        st.detail.clear();
        if let Some(pb) = &self.bar {
            pb.set_position(st.pos);
            pb.set_message(point_text(&st));
        }
        // A stage's first point always shows: it says what the stage is.
        let first = st.next == 1;
        self.plain(&mut st, first);
    }

    /// What the current point is doing ("gloo iteration 40/200").
    pub fn detail(&self, text: impl Into<String>) {
        let mut st = self.state();
        let text = text.into();
        if st.detail == text {
            return;
        }
        st.detail = text;
        if let Some(pb) = &self.bar {
            pb.set_message(point_text(&st));
        }
        self.plain(&mut st, false);
    }

    /// `done` of `total` of the current point are done (never moves back).
    pub fn fraction(&self, done: u64, total: u64) {
        let mut st = self.state();
        let Some(&w) = st.next.checked_sub(1).and_then(|i| st.weights.get(i)) else { return };
        let at = done_weight(&st) + (w as f64 * done.min(total) as f64 / total.max(1) as f64) as u64;
        if at > st.pos {
            st.pos = at;
            if let Some(pb) = &self.bar {
                pb.set_position(at);
            }
        }
    }

    /// One result line on stdout, drawn above the bar.
    pub fn say(&self, line: impl AsRef<str>) {
        println(line.as_ref());
    }

    /// The run is over: the bar goes, plain mode says how long it took.
    pub fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
        if self.mode == Mode::Plain {
            eprintln(&format!("{}: done in {}", self.what, clock(self.t0.elapsed())));
        }
    }

    fn plain(&self, st: &mut State, always: bool) {
        if self.mode != Mode::Plain {
            return;
        }
        let now = Instant::now();
        if !always && st.last_plain.is_some_and(|t| now.duration_since(t) < PLAIN_EVERY) {
            return;
        }
        st.last_plain = Some(now);
        eprintln(&plain_line(&self.what, st, self.t0.elapsed(), now.duration_since(st.stage_t0)));
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
            multi().remove(pb);
            BARS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn join(what: &str, stage: &str) -> String {
    if stage.is_empty() {
        what.to_owned()
    } else {
        format!("{what}: {stage}")
    }
}

/// Weight of the points before the one under way.
fn done_weight(st: &State) -> u64 {
    st.weights.iter().take(st.next.saturating_sub(1)).sum()
}

/// "point 2/7 bytes=4194304 (gloo iteration 3/10)".
fn point_text(st: &State) -> String {
    let mut s = if st.weights.is_empty() {
        st.point.clone()
    } else {
        format!("point {}/{} {}", st.next.min(st.weights.len()), st.weights.len(), st.point)
    };
    if !st.detail.is_empty() {
        s.push_str(&format!(" ({})", st.detail));
    }
    s.trim().to_owned()
}

/// Time left of the stage, from the weight done so far at the rate so far.
fn eta(st: &State, stage_elapsed: Duration) -> Option<Duration> {
    let total: u64 = st.weights.iter().sum();
    let done = st.pos;
    (done > 0 && total > done).then(|| stage_elapsed.mul_f64((total - done) as f64 / done as f64))
}

/// One line of plain mode.
fn plain_line(what: &str, st: &State, elapsed: Duration, stage_elapsed: Duration) -> String {
    let mut s = join(what, &st.stage);
    let point = point_text(st);
    if !point.is_empty() {
        s.push_str(&format!(" · {point}"));
    }
    s.push_str(&format!(" · {} elapsed", clock(elapsed)));
    if let Some(left) = eta(st, stage_elapsed) {
        s.push_str(&format!(" · ETA {}", clock(left)));
    }
    s
}

/// mm:ss, or h:mm:ss from an hour.
pub fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{:02}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(weights: &[u64], next: usize, point: &str) -> State {
        State {
            stage: "experiment 3/7 agg-throughput".into(),
            stage_t0: Instant::now(),
            weights: weights.to_vec(),
            next,
            pos: weights.iter().take(next.saturating_sub(1)).sum(),
            point: point.into(),
            detail: String::new(),
            last_plain: None,
        }
    }

    #[test]
    fn clock_reads_as_minutes_then_hours() {
        assert_eq!(clock(Duration::from_secs(0)), "00:00");
        assert_eq!(clock(Duration::from_secs(751)), "12:31");
        assert_eq!(clock(Duration::from_secs(3600 + 62)), "1:01:02");
    }

    #[test]
    fn eta_weighs_points() {
        // The 1-unit point took 10 s: the 3-unit point left takes 30 s.
        let st = state(&[1, 3], 2, "bytes=big");
        assert_eq!(eta(&st, Duration::from_secs(10)), Some(Duration::from_secs(30)));
        // Nothing done yet: no ETA rather than a made-up one.
        assert_eq!(eta(&state(&[1, 3], 1, "small"), Duration::from_secs(10)), None);
        assert_eq!(eta(&state(&[], 0, ""), Duration::from_secs(10)), None);
        // Skipped points (weight 0) are no progress: no ETA extrapolated from them.
        let p = Progress::hidden();
        p.plan(&[0, 0, 100_000_000]);
        for label in ["skipped", "skipped", "bytes=big"] {
            p.point(label);
        }
        assert_eq!(eta(&p.state(), Duration::from_secs(2)), None);
    }

    #[test]
    fn plain_line_says_stage_point_elapsed_and_eta() {
        let mut st = state(&[2, 2, 4], 2, "bytes=4194304");
        st.detail = "gloo iteration 3/10".into();
        assert_eq!(
            plain_line("kccl bench all", &st, Duration::from_secs(751), Duration::from_secs(20)),
            "kccl bench all: experiment 3/7 agg-throughput · point 2/3 bytes=4194304 (gloo iteration 3/10) \
             · 12:31 elapsed · ETA 01:00"
        );
        let st = state(&[], 0, "");
        assert_eq!(
            plain_line("kccl cluster up", &st, Duration::from_secs(3), Duration::ZERO),
            "kccl cluster up: experiment 3/7 agg-throughput · 00:03 elapsed"
        );
    }

    #[test]
    fn hidden_progress_takes_every_call() {
        let p = Progress::hidden();
        p.stage("s");
        p.plan(&[0, 5]);
        p.point("a");
        p.detail("d");
        p.point("b");
        p.point("past the plan");
        p.finish();
        assert_eq!(done_weight(&p.state()), 5);
    }

    #[test]
    fn fraction_moves_within_a_point_and_never_back() {
        let p = Progress::hidden();
        p.plan(&[10, 10]);
        p.fraction(1, 2); // before any point: nothing to move
        assert_eq!(p.state().pos, 0);
        p.point("a");
        p.point("b");
        p.fraction(1, 2);
        assert_eq!(p.state().pos, 15);
        p.fraction(1, 10);
        assert_eq!(p.state().pos, 15);
        p.fraction(20, 10);
        assert_eq!(p.state().pos, 20);
    }
}
