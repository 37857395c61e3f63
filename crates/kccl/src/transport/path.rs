//! Which data path a collective runs on: what the caller asks for
//! ([`PathChoice`]) and what the runtime took ([`Path`]).  Every collective
//! (broadcast, aggregation, scatter-gather) resolves the same choice.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathChoice {
    Kernel,
    User,
    Auto,
}

impl FromStr for PathChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(PathChoice::Kernel),
            "user" => Ok(PathChoice::User),
            "auto" => Ok(PathChoice::Auto),
            _ => Err(Error::Usage(format!("unknown path '{s}': use kernel, user or auto"))),
        }
    }
}

/// What the runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    Kernel,
    User,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Path::Kernel => "kernel",
            Path::User => "user",
        })
    }
}
