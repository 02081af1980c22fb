//! [`PoolError`]: what can go wrong allocating or registering memory.

use std::io;

/// An error from the memory pool or from registering user memory.
///
/// `#[non_exhaustive]`. Converts into [`io::Error`] with a deliberate
/// [`io::ErrorKind`] (listed on each variant), keeping this value as the
/// source so callers can downcast it back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// `len` bytes were requested but the largest size class is `max_class`
    /// bytes ([`PoolConfig::max_class_size`](super::PoolConfig::max_class_size)).
    /// Maps to [`io::ErrorKind::InvalidInput`].
    #[error(
        "a buffer of {len} bytes is larger than the pool's largest size class ({max_class} bytes)"
    )]
    TooLarge {
        /// The requested length in bytes.
        len: usize,
        /// The largest size class in bytes.
        max_class: usize,
    },

    /// No free buffer of size class `class` bytes is left and registering
    /// another slab would exceed `max_registered_bytes`. Returned by
    /// [`MemoryPool::try_alloc`](super::MemoryPool::try_alloc) always, and by
    /// [`MemoryPool::alloc`](super::MemoryPool::alloc) under
    /// [`ExhaustedPolicy::Error`](super::ExhaustedPolicy::Error).
    /// Maps to [`io::ErrorKind::OutOfMemory`].
    #[error(
        "memory pool exhausted: no free {class}-byte buffer and {max_registered_bytes} bytes already registered"
    )]
    Exhausted {
        /// The size class (bytes) that had no free buffer.
        class: usize,
        /// The configured bound on registered bytes.
        max_registered_bytes: u64,
    },

    /// Registering `len` bytes as a memory region failed (`ibv_reg_mr`, or
    /// the heap allocation of a slab before it). Maps to the kind of `source`
    /// (for example `OutOfMemory` for `ENOMEM`).
    #[error("registering {len} bytes of memory failed: {source}")]
    Registration {
        /// The number of bytes that were to be registered.
        len: usize,
        /// The OS error reported.
        #[source]
        source: io::Error,
    },

    /// The [`PoolConfig`](super::PoolConfig) is inconsistent; `reason` says
    /// which rule it breaks. Maps to [`io::ErrorKind::InvalidInput`].
    #[error("invalid memory pool configuration: {reason}")]
    InvalidConfig {
        /// The rule the configuration breaks.
        reason: &'static str,
    },

    /// User memory of zero bytes cannot be registered (libibverbs rejects
    /// empty memory regions). Maps to [`io::ErrorKind::InvalidInput`].
    #[error("cannot register an empty memory region")]
    EmptyRegion,

    /// Opening the RDMA device for [`MemoryPool::for_device`](super::MemoryPool::for_device)
    /// failed. Maps to the kind of the inner error.
    #[error("opening the RDMA device for the memory pool failed: {0}")]
    Device(#[source] Box<crate::Error>),
}

impl PoolError {
    /// The [`io::ErrorKind`] this error maps onto.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            PoolError::TooLarge { .. }
            | PoolError::InvalidConfig { .. }
            | PoolError::EmptyRegion => io::ErrorKind::InvalidInput,
            PoolError::Exhausted { .. } => io::ErrorKind::OutOfMemory,
            PoolError::Registration { source, .. } => source.kind(),
            PoolError::Device(e) => e.kind(),
        }
    }
}

impl From<PoolError> for io::Error {
    fn from(err: PoolError) -> Self {
        io::Error::new(err.kind(), err)
    }
}
