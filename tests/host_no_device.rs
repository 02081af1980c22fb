//! Host test: these build hosts have no RDMA device, and the listing must say
//! so with the typed error, never panic. (Inside the Soft-RoCE guest this
//! binary is not run; `tests/guest_devices.rs` covers the device case.)

use std::io;
use std::net::{IpAddr, Ipv4Addr};

use tokio_rdma::{Error, verbs};

#[test]
fn no_rdma_device_is_a_typed_error() {
    if std::env::var_os("SOFTROCE_GUEST").is_some() {
        panic!("host_no_device must not run inside the Soft-RoCE guest");
    }
    // scripts/install-deps installs rdma-core, so libibverbs loads and finds
    // no device.
    match verbs::devices() {
        Err(Error::NoDevice) => {}
        other => panic!("expected Error::NoDevice on a host without RDMA, got {other:?}"),
    }
    let err = verbs::select_device(IpAddr::V4(Ipv4Addr::new(10, 11, 0, 1))).unwrap_err();
    assert!(matches!(err, Error::NoDevice), "{err:?}");
    assert_eq!(err.to_string(), "no RDMA device found on this host");
    let io: io::Error = err.into();
    assert_eq!(io.kind(), io::ErrorKind::NotFound);
}

#[tokio::test]
async fn connect_and_bind_without_device_give_no_device() {
    let err = tokio_rdma::RdmaStream::connect("10.11.0.1:7471")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(matches!(inner, Some(Error::NoDevice)), "{err:?}");

    let err = tokio_rdma::RdmaListener::bind("0.0.0.0:0")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(matches!(inner, Some(Error::NoDevice)), "{err:?}");
}
