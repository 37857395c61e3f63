//! The CLI's errors: the library's and the testbed's pass through unchanged;
//! the CLI adds only its own (a command-line value that cannot work, a file it
//! reads or writes). Every one is printed as `kccl: error: <message>`.

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kccl(#[from] kccl::Error),

    #[error(transparent)]
    Testbed(#[from] kccl_testbed::Error),

    /// A command-line value that cannot work, and what to pass instead.
    #[error("{0}")]
    Usage(String),

    #[error("{what} needs root (CAP_NET_ADMIN and CAP_BPF); run it with sudo")]
    NotRoot { what: String },

    /// The demo's verdict found wrong results or failed runs (it names them).
    #[error("the demo found {bad} of {runs} runs wrong or failed (the verdict above names them)")]
    DemoFailed { bad: usize, runs: usize },

    #[error("{step}: {source}")]
    Io {
        step: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with the step that failed.
    pub fn io(step: impl Into<String>, source: io::Error) -> Self {
        Error::Io { step: step.into(), source }
    }
}

impl From<kccl_testbed::peers::PeerError> for Error {
    fn from(e: kccl_testbed::peers::PeerError) -> Self {
        Error::Testbed(e.into())
    }
}
