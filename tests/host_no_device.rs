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
    assert_eq!(
        err.to_string(),
        "no RDMA device found on this host (`rdma link` or `ibv_devices` lists them; \
         Soft-RoCE: `rdma link add rxe0 type rxe netdev IFACE`)"
    );
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

#[tokio::test]
async fn message_endpoints_without_device_give_no_device_and_check_config() {
    use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener};
    let err = MessageEndpoint::connect("10.11.0.1:7480")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(matches!(inner, Some(Error::NoDevice)), "{err:?}");
    let err = MessageListener::bind("0.0.0.0:0").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");

    // Bad values are refused before any device is looked at.
    for (cfg, field) in [
        (MessageConfig::new().eager_buf_len(19), "eager_buf_len"),
        (MessageConfig::new().max_message_len(0), "max_message_len"),
        (
            MessageConfig::new().max_message_len((1 << 48) + 1),
            "max_message_len",
        ),
        (MessageConfig::new().max_read_len(0), "max_read_len"),
        (
            MessageConfig::new().max_rendezvous_in_flight(0),
            "max_rendezvous_in_flight",
        ),
        (MessageConfig::new().send_queue_limit(0), "send_queue_limit"),
        (MessageConfig::new().send_queue_bytes(0), "send_queue_bytes"),
        (MessageConfig::new().max_sge(0), "max_sge"),
        (MessageConfig::new().max_sge(65), "max_sge"),
    ] {
        let err = MessageEndpoint::connect_with("10.11.0.1:7480", &cfg)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{field}: {err}");
        let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
        assert!(
            matches!(inner, Some(Error::InvalidConfig { field: f, .. }) if *f == field),
            "{field}: {err:?}"
        );
    }
}
