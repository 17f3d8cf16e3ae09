//! Every call's status, with the engine's message for this thread.
use std::ffi::CStr;
use std::fmt;

use zeroshard_sys as sys;

/// The status codes of `zs_status` other than `ZS_OK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    InvalidArgument,
    InvalidHandle,
    InvalidState,
    InvalidConfig,
    OutOfMemory,
    Timeout,
    Comm,
    Bootstrap,
    NotSupported,
    BufferSize,
    Internal,
    /// A file could not be read or written, or failed its checksum.
    Io,
    /// Healing on: a rank fell silent (stopped or died); the message names it.
    RankLost,
    /// Healing on: a shard and the copy of it were lost together.
    StateLost,
    /// Healing, in a replacement: the survivors went on without its rank.
    NotTaken,
    /// A code this crate does not know (a newer library).
    Other(i32),
}

impl Status {
    pub fn from_code(code: sys::zs_status) -> Self {
        match code {
            sys::ZS_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::ZS_ERR_INVALID_HANDLE => Status::InvalidHandle,
            sys::ZS_ERR_INVALID_STATE => Status::InvalidState,
            sys::ZS_ERR_INVALID_CONFIG => Status::InvalidConfig,
            sys::ZS_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::ZS_ERR_TIMEOUT => Status::Timeout,
            sys::ZS_ERR_COMM => Status::Comm,
            sys::ZS_ERR_BOOTSTRAP => Status::Bootstrap,
            sys::ZS_ERR_NOT_SUPPORTED => Status::NotSupported,
            sys::ZS_ERR_BUFFER_SIZE => Status::BufferSize,
            sys::ZS_ERR_INTERNAL => Status::Internal,
            sys::ZS_ERR_IO => Status::Io,
            sys::ZS_ERR_RANK_LOST => Status::RankLost,
            sys::ZS_ERR_STATE_LOST => Status::StateLost,
            sys::ZS_ERR_NOT_TAKEN => Status::NotTaken,
            other => Status::Other(other),
        }
    }

    pub fn code(self) -> sys::zs_status {
        match self {
            Status::InvalidArgument => sys::ZS_ERR_INVALID_ARGUMENT,
            Status::InvalidHandle => sys::ZS_ERR_INVALID_HANDLE,
            Status::InvalidState => sys::ZS_ERR_INVALID_STATE,
            Status::InvalidConfig => sys::ZS_ERR_INVALID_CONFIG,
            Status::OutOfMemory => sys::ZS_ERR_OUT_OF_MEMORY,
            Status::Timeout => sys::ZS_ERR_TIMEOUT,
            Status::Comm => sys::ZS_ERR_COMM,
            Status::Bootstrap => sys::ZS_ERR_BOOTSTRAP,
            Status::NotSupported => sys::ZS_ERR_NOT_SUPPORTED,
            Status::BufferSize => sys::ZS_ERR_BUFFER_SIZE,
            Status::Internal => sys::ZS_ERR_INTERNAL,
            Status::Io => sys::ZS_ERR_IO,
            Status::RankLost => sys::ZS_ERR_RANK_LOST,
            Status::StateLost => sys::ZS_ERR_STATE_LOST,
            Status::NotTaken => sys::ZS_ERR_NOT_TAKEN,
            Status::Other(c) => c,
        }
    }

    /// The library's name for it ("ZS_ERR_TIMEOUT").
    pub fn name(self) -> String {
        // SAFETY: zs_status_string returns a static string for any value.
        unsafe { CStr::from_ptr(sys::zs_status_string(self.code())) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A failed call: its status and the engine's message (what was wrong, with
/// which value), or this crate's own for checks made before calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Self {
        Error {
            status,
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Ok, or the status with zs_last_error(), read on this thread right away.
pub(crate) fn check(code: sys::zs_status) -> Result<()> {
    if code == sys::ZS_OK {
        return Ok(());
    }
    // SAFETY: zs_last_error returns this thread's message, valid until the
    // next zeroshard call on this thread; it is copied at once.
    let message = unsafe { CStr::from_ptr(sys::zs_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(Error {
        status: Status::from_code(code),
        message,
    })
}
