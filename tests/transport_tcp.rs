//! The transport suite (`tests/transport_suite`) over TCP on the host, at
//! full size, plus the host-only checks of the transport switch: this host
//! has no RDMA device, so `auto://` connects and listens over TCP.
//!
//! Needs features `hyper`, `axum` and `tonic` (`cargo test --all-features`).

mod transport_suite;

use std::io;
use std::time::Duration;

use tokio_rdma::transport::{AddrParseError, Listener, Stream, Transport, TransportAddr};
use transport_suite::{FULL, Http, within};

const LIMIT: Duration = Duration::from_secs(300);

fn base() -> TransportAddr {
    "tcp://127.0.0.1:0".parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_http1_pooled_client() {
    within(
        LIMIT,
        "hyper HTTP/1.1",
        transport_suite::hyper_pooled_client(&base(), Http::One, FULL),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_http2_pooled_client() {
    within(
        LIMIT,
        "hyper HTTP/2",
        transport_suite::hyper_pooled_client(&base(), Http::Two, FULL),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_uri_scheme_overrides_connector_transport() {
    within(
        LIMIT,
        "hyper scheme",
        transport_suite::hyper_scheme_selects_transport(&base(), Transport::Rdma),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_connect_info() {
    within(LIMIT, "axum", transport_suite::axum_connect_info(&base())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_unary_server_streaming_bidi() {
    within(LIMIT, "tonic", transport_suite::tonic_rpcs(&base(), 1000)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_both_directions_close_notify() {
    within(
        LIMIT,
        "tls",
        transport_suite::tls_half_close(&base(), 3 << 20, 2 << 20),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_length_delimited() {
    within(
        LIMIT,
        "framed",
        transport_suite::framed_length_delimited(&base(), FULL.frames),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_falls_back_to_tcp_only_peer() {
    within(
        LIMIT,
        "auto fallback",
        transport_suite::auto_falls_back_to_tcp_peer("127.0.0.1", 0),
    )
    .await;
}

/// Without an RDMA device an auto listener serves TCP only, on the port the
/// kernel picked, and auto clients reach it over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_listener_without_device_serves_tcp() {
    let listener = Listener::bind("auto://127.0.0.1:0").await.unwrap();
    assert_eq!(listener.transport(), Transport::Auto);
    assert!(listener.serves(Transport::Tcp));
    assert!(!listener.serves(Transport::Rdma));
    assert!(!listener.serves(Transport::Auto));
    assert_eq!(listener.rdma_local_addr(), None);
    let port = listener.local_addr().unwrap().port();
    assert_ne!(port, 0);
    for scheme in ["auto", "tcp"] {
        let addr: TransportAddr = format!("{scheme}://127.0.0.1:{port}").parse().unwrap();
        let got = transport_suite::round_trip(&listener, &addr, b"auto listener").await;
        assert_eq!(got, (Transport::Tcp, Transport::Tcp), "{scheme}");
    }
}

/// `rdma://` on a host without a device fails with the typed error, for
/// both connect and bind; nothing falls back.
#[tokio::test]
async fn rdma_without_device_is_not_found() {
    let err = Stream::connect("rdma://127.0.0.1:7471").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    let err = Listener::bind("rdma://127.0.0.1:0").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
}

/// Bad addresses are `InvalidInput` with the typed parse error inside.
#[tokio::test]
async fn bad_addresses_are_invalid_input() {
    for (addr, check) in [
        (
            "udp://127.0.0.1:1",
            (|e| matches!(e, AddrParseError::UnknownScheme { .. })) as fn(&AddrParseError) -> bool,
        ),
        ("tcp://127.0.0.1", |e| {
            matches!(e, AddrParseError::MissingPort { .. })
        }),
        ("127.0.0.1:1", |e| {
            matches!(e, AddrParseError::MissingScheme { .. })
        }),
    ] {
        let err = Stream::connect(addr).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{addr}");
        let inner = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<AddrParseError>())
            .unwrap();
        assert!(check(inner), "{addr}: {inner:?}");
        let err = Listener::bind(addr).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{addr}");
    }
}

/// `auto://` to a port where nothing listens: RDMA is unavailable (no
/// device), TCP is refused, and that TCP error is what the caller sees.
#[tokio::test]
async fn auto_reports_the_tcp_error_after_fallback() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = Stream::connect(format!("auto://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    // The message names both attempts.
    let msg = err.to_string();
    assert!(msg.contains("RDMA failed"), "{msg}");
    assert!(msg.contains("then TCP failed"), "{msg}");
    assert!(msg.contains(&format!("auto://127.0.0.1:{port}")), "{msg}");
    match tokio_rdma::Error::from_io(&err) {
        Some(tokio_rdma::Error::FallbackFailed { addr, rdma, tcp }) => {
            assert_eq!(*addr, format!("auto://127.0.0.1:{port}"));
            assert!(matches!(**rdma, tokio_rdma::Error::NoDevice), "{rdma:?}");
            assert_eq!(tcp.raw_os_error(), Some(libc::ECONNREFUSED));
        }
        other => panic!("want Error::FallbackFailed, got {other:?}"),
    }
}

/// On a host without RDMA every `auto://` connect falls back to TCP, and
/// each one is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_fallbacks_are_counted() {
    let listener = Listener::bind("tcp://127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let before = tokio_rdma::transport::fallback_count();
    for _ in 0..3 {
        let s = Stream::connect(format!("auto://127.0.0.1:{port}"))
            .await
            .unwrap();
        assert_eq!(s.transport(), Transport::Tcp);
        let (_accepted, _) = listener.accept().await.unwrap();
    }
    // Other tests of this binary may fall back at the same time.
    assert!(tokio_rdma::transport::fallback_count() >= before + 3);
}

/// `accept` is cancel-safe: dropping pending accepts in `select!` loses no
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_is_cancel_safe() {
    let listener = Listener::bind("auto://127.0.0.1:0").await.unwrap();
    let addr: TransportAddr = format!("tcp://127.0.0.1:{}", listener.local_addr().unwrap().port())
        .parse()
        .unwrap();
    let mut clients = Vec::new();
    for _ in 0..20 {
        clients.push(Stream::connect(&addr).await.unwrap());
    }
    let mut accepted = 0;
    while accepted < 20 {
        tokio::select! {
            r = listener.accept() => { r.unwrap(); accepted += 1; }
            _ = tokio::task::yield_now() => {}
        }
    }
    assert_eq!(accepted, 20);
}

/// A port on 127.0.0.1 where nothing listens (bound, then closed).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// TCP errors of the switch name the operation and the address, keep the
/// OS error's kind, and carry the OS error as the payload's source.
#[tokio::test]
async fn tcp_errors_name_the_operation_and_address() {
    let port = closed_port();
    let err = Stream::connect(format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "connect tcp://127.0.0.1:{port}: {}",
            io::Error::from_raw_os_error(libc::ECONNREFUSED)
        )
    );
    match tokio_rdma::Error::from_io(&err) {
        Some(tokio_rdma::Error::Tcp { op, addr, source }) => {
            assert_eq!(*op, "connect");
            assert_eq!(*addr, format!("tcp://127.0.0.1:{port}"));
            assert_eq!(source.raw_os_error(), Some(libc::ECONNREFUSED));
        }
        other => panic!("want Error::Tcp, got {other:?}"),
    }

    let taken = Listener::bind("tcp://127.0.0.1:0").await.unwrap();
    let port = taken.local_addr().unwrap().port();
    for scheme in ["tcp", "auto"] {
        let err = Listener::bind(format!("{scheme}://127.0.0.1:{port}"))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{scheme}: {err}");
        assert_eq!(
            err.to_string(),
            format!(
                "bind {scheme}://127.0.0.1:{port}: {}",
                io::Error::from_raw_os_error(libc::EADDRINUSE)
            ),
            "{scheme}"
        );
        assert!(
            matches!(
                tokio_rdma::Error::from_io(&err),
                Some(tokio_rdma::Error::Tcp { op: "bind", source, .. })
                    if source.raw_os_error() == Some(libc::EADDRINUSE)
            ),
            "{err:?}"
        );
    }
}

/// `transport::channel` takes a string; a refused first connection is an
/// `io::Error` of kind `ConnectionRefused`, a bad address `InvalidInput`.
#[tokio::test]
async fn tonic_channel_errors_keep_the_connect_kind() {
    let port = closed_port();
    let err = tokio_rdma::transport::channel(format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("tonic channel to tcp://127.0.0.1:{port}: ")),
        "{msg}"
    );
    assert!(
        msg.ends_with(&format!(
            "connect tcp://127.0.0.1:{port}: {}",
            io::Error::from_raw_os_error(libc::ECONNREFUSED)
        )),
        "{msg}"
    );
    assert!(
        matches!(
            tokio_rdma::Error::find(&err),
            Some(tokio_rdma::Error::Tcp { op: "connect", .. })
        ),
        "{err:?}"
    );
    let err = tokio_rdma::transport::channel("tcp://127.0.0.1")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    assert!(
        err.get_ref()
            .and_then(|e| e.downcast_ref::<AddrParseError>())
            .is_some(),
        "{err:?}"
    );
}
