//! Transport switch: TCP or RDMA chosen by address (see the crate docs).
