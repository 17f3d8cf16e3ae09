//! The header's small enums as Rust enums, and the element types that may
//! cross the boundary in slices.
use zeroshard_sys as sys;

use crate::error::{Error, Result, Status};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// Raw bytes: collectives only.
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
    pub(crate) fn code(self) -> sys::zs_dtype {
        match self {
            DType::F32 => sys::ZS_FLOAT32,
            DType::BF16 => sys::ZS_BFLOAT16,
            DType::F16 => sys::ZS_FLOAT16,
            DType::U8 => sys::ZS_UINT8,
        }
    }
    pub(crate) fn from_code(code: sys::zs_dtype) -> Result<Self> {
        Ok(match code {
            sys::ZS_FLOAT32 => DType::F32,
            sys::ZS_BFLOAT16 => DType::BF16,
            sys::ZS_FLOAT16 => DType::F16,
            sys::ZS_UINT8 => DType::U8,
            other => {
                return Err(Error::new(
                    Status::Internal,
                    format!("unknown dtype code {other}"),
                ))
            }
        })
    }
}

/// A 16-bit float's bits (bfloat16 or float16): the engine stores them; this
/// crate does not do arithmetic on them.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Half16(pub u16);

/// Types whose slices may be handed to the engine or viewed over its memory.
///
/// # Safety
/// Implementors are plain data, valid for every bit pattern, whose size is
/// that of each dtype `accepts` says yes to.
pub unsafe trait Element: Copy + Send + Sync + 'static {
    /// The dtype used for collectives of this element type.
    const DTYPE: DType;
    fn accepts(dtype: DType) -> bool {
        dtype == Self::DTYPE
    }
}
// SAFETY: plain numbers of the dtype's size.
unsafe impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
unsafe impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
unsafe impl Element for Half16 {
    const DTYPE: DType = DType::BF16;
    fn accepts(dtype: DType) -> bool {
        matches!(dtype, DType::BF16 | DType::F16)
    }
}

pub(crate) fn expect_element<T: Element>(dtype: DType, what: &str) -> Result<()> {
    if T::accepts(dtype) {
        Ok(())
    } else {
        Err(Error::new(
            Status::InvalidArgument,
            format!(
                "{what} holds {dtype:?} elements, not {}",
                std::any::type_name::<T>()
            ),
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

impl ReduceOp {
    pub(crate) fn code(self) -> sys::zs_reduce_op {
        match self {
            ReduceOp::Sum => sys::ZS_SUM,
            ReduceOp::Avg => sys::ZS_AVG,
            ReduceOp::Max => sys::ZS_MAX,
            ReduceOp::Min => sys::ZS_MIN,
        }
    }
}

/// Where memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

impl Device {
    pub(crate) fn from_codes(kind: sys::zs_device_type, id: i32) -> Self {
        if kind == sys::ZS_DEVICE_CUDA {
            Device::Cuda(id)
        } else {
            Device::Cpu
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamStatus {
    NotAvailable,
    Inflight,
    Available,
}

impl ParamStatus {
    pub(crate) fn from_code(code: sys::zs_param_status) -> Self {
        match code {
            sys::ZS_PARAM_INFLIGHT => ParamStatus::Inflight,
            sys::ZS_PARAM_AVAILABLE => ParamStatus::Available,
            _ => ParamStatus::NotAvailable,
        }
    }
}

/// One of the context's own groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    World,
    Partition,
    MicsShard,
    MicsReplica,
    Hpz,
    MicsInter,
    MicsIntra,
}

impl GroupKind {
    pub(crate) fn code(self) -> sys::zs_group_kind {
        match self {
            GroupKind::World => sys::ZS_GROUP_WORLD,
            GroupKind::Partition => sys::ZS_GROUP_PARTITION,
            GroupKind::MicsShard => sys::ZS_GROUP_MICS_SHARD,
            GroupKind::MicsReplica => sys::ZS_GROUP_MICS_REPLICA,
            GroupKind::Hpz => sys::ZS_GROUP_HPZ,
            GroupKind::MicsInter => sys::ZS_GROUP_MICS_INTER,
            GroupKind::MicsIntra => sys::ZS_GROUP_MICS_INTRA,
        }
    }
}

/// A timeout for `wait`: `None` waits forever.
pub(crate) fn timeout_ms(t: Option<std::time::Duration>) -> i32 {
    match t {
        None => sys::ZS_WAIT_FOREVER,
        Some(d) => d.as_millis().min(i32::MAX as u128) as i32,
    }
}
