//! The sans-IO protocol core: handshake encoding and the stream state
//! machine. No I/O, no clock, no `unsafe`; driven by the runtime layer and
//! tested deterministically in memory.
#![forbid(unsafe_code)]
