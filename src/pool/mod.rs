//! Registered memory pool (see the crate docs).
