//! What is reduced: the operations ([`AggOp`]), the element types ([`DType`],
//! [`Element`]) and float32 quantization ([`Quant`]).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::wire::{DT_F32Q, DT_I32, DT_I64, OP_AVG, OP_COUNT, OP_MAX, OP_MIN, OP_SUM};

use super::codec::{Dst, Src};

/// Aggregation operation (enum kccl_agg_op).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AggOp {
    Sum,
    /// Per element: how many members' values are non-zero.
    Count,
    Max,
    Min,
    /// Sum divided by the number of members (integers: truncated toward 0).
    Avg,
}

impl AggOp {
    pub fn wire(self) -> u8 {
        match self {
            AggOp::Sum => OP_SUM,
            AggOp::Count => OP_COUNT,
            AggOp::Max => OP_MAX,
            AggOp::Min => OP_MIN,
            AggOp::Avg => OP_AVG,
        }
    }

    pub fn from_wire(v: u8) -> Option<AggOp> {
        match v {
            OP_SUM => Some(AggOp::Sum),
            OP_COUNT => Some(AggOp::Count),
            OP_MAX => Some(AggOp::Max),
            OP_MIN => Some(AggOp::Min),
            OP_AVG => Some(AggOp::Avg),
            _ => None,
        }
    }
}

impl fmt::Display for AggOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AggOp::Sum => "SUM",
            AggOp::Count => "COUNT",
            AggOp::Max => "MAX",
            AggOp::Min => "MIN",
            AggOp::Avg => "AVG",
        })
    }
}

impl FromStr for AggOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(AggOp::Sum),
            "count" => Ok(AggOp::Count),
            "max" => Ok(AggOp::Max),
            "min" => Ok(AggOp::Min),
            "avg" | "average" => Ok(AggOp::Avg),
            _ => Err(Error::Usage(format!("unknown aggregation op '{s}': use sum, count, max, min or avg"))),
        }
    }
}

/// Element type on the wire (enum kccl_dtype).  float32 data is F32Q for
/// SUM/AVG (quantized); its MAX/MIN/COUNT travel exactly as I32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    I32,
    I64,
    F32Q,
}

impl DType {
    pub fn wire(self) -> u8 {
        match self {
            DType::I32 => DT_I32,
            DType::I64 => DT_I64,
            DType::F32Q => DT_F32Q,
        }
    }

    pub fn from_wire(v: u8) -> Option<DType> {
        match v {
            DT_I32 => Some(DType::I32),
            DT_I64 => Some(DType::I64),
            DT_F32Q => Some(DType::F32Q),
            _ => None,
        }
    }

    pub fn elem_size(self) -> usize {
        match self {
            DType::I64 => 8,
            _ => 4,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for f32 {}
}

/// Element types that can be aggregated: i32, i64, f32.
pub trait Element: sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    const NAME: &'static str;
    #[doc(hidden)]
    fn src(data: &[Self]) -> Src<'_>;
    #[doc(hidden)]
    fn dst(out: &mut [Self]) -> Dst<'_>;
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    const NAME: &'static str = "i32";
    fn src(data: &[Self]) -> Src<'_> {
        Src::I32(data)
    }
    fn dst(out: &mut [Self]) -> Dst<'_> {
        Dst::I32(out)
    }
}

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    const NAME: &'static str = "i64";
    fn src(data: &[Self]) -> Src<'_> {
        Src::I64(data)
    }
    fn dst(out: &mut [Self]) -> Dst<'_> {
        Dst::I64(out)
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32Q;
    const NAME: &'static str = "f32";
    fn src(data: &[Self]) -> Src<'_> {
        Src::F32(data)
    }
    fn dst(out: &mut [Self]) -> Dst<'_> {
        Dst::F32(out)
    }
}

/// float32 quantization for SUM/AVG.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Quant {
    /// Shared exponent per chunk, agreed by a MAX pre-pass: cannot overflow.
    #[default]
    Auto,
    /// `q = round(x * s)` (AggBox: 1e8).  Elements with `|x * s|` beyond
    /// int32 are refused; int32 sums that overflow are redone in int64.
    Fixed(f64),
}
