//! The transport suite (`tests/transport_suite`) over RDMA, inside the
//! Soft-RoCE guest (rxe0 on 10.11.0.1; `integration/softroce`), plus the
//! auto-mode checks that need a device: an auto client picks RDMA against an
//! RDMA peer and falls back to TCP against a TCP-only one, and an auto
//! listener serves both on one port number. Fails, never skips, without
//! rxe0.
//!
//! Sizes: the same request counts as the host run (1000 sequential and 100
//! concurrent HTTP requests, bodies of 0 B, 64 B and 1 MiB), but the 1 MiB
//! body is every 25th request instead of every 3rd ([`GUEST`]), and 300
//! instead of 1000 `Framed` frames, because the guest's CPU is emulated
//! (TCG, a few MB/s); TLS sends 1 MiB + 512 KiB instead of 3 + 2 MiB.
//!
//! Needs features `hyper`, `axum` and `tonic`.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it), so
//! host builds (`cargo test --all-features` included) leave it empty.
#![cfg(tokio_rdma_guest)]

mod common;
mod transport_suite;

use std::time::Duration;

use tokio_rdma::transport::{Listener, Transport, TransportAddr};
use transport_suite::{Http, Scale, within};

const IP: &str = "10.11.0.1";
const LIMIT: Duration = Duration::from_secs(300);

/// Request counts as on the host; fewer 1 MiB bodies and frames (TCG).
const GUEST: Scale = Scale {
    sequential: 1000,
    concurrent: 100,
    big_every: 25,
    frames: 300,
};

fn base() -> TransportAddr {
    format!("rdma://{IP}:0").parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_http1_pooled_client() {
    within(
        LIMIT,
        "hyper HTTP/1.1",
        transport_suite::hyper_pooled_client(&base(), Http::One, GUEST),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_http2_pooled_client() {
    within(
        LIMIT,
        "hyper HTTP/2",
        transport_suite::hyper_pooled_client(&base(), Http::Two, GUEST),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_uri_scheme_overrides_connector_transport() {
    within(
        LIMIT,
        "hyper scheme",
        transport_suite::hyper_scheme_selects_transport(&base(), Transport::Tcp),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_connect_info() {
    within(LIMIT, "axum", transport_suite::axum_connect_info(&base())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_unary_server_streaming_bidi() {
    within(LIMIT, "tonic", transport_suite::tonic_rpcs(&base(), 300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_both_directions_close_notify() {
    within(
        LIMIT,
        "tls",
        transport_suite::tls_half_close(&base(), 1 << 20, 512 << 10),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_length_delimited() {
    within(
        LIMIT,
        "framed",
        transport_suite::framed_length_delimited(&base(), GUEST.frames),
    )
    .await;
}

/// An RDMA-capable host, a peer with only a TCP listener on that port: the
/// RDMA connect is refused and the auto client falls back to TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_falls_back_to_tcp_only_peer() {
    within(
        LIMIT,
        "auto fallback",
        // Over iWARP the RDMA attempt is itself a TCP connection to that
        // port: the TCP-only peer accepts it and reads MPA's request key.
        transport_suite::auto_falls_back_to_tcp_peer(IP, usize::from(common::iwarp())),
    )
    .await;
}

/// An auto listener on rxe0's address serves RDMA and TCP on one port
/// number; an auto client picks RDMA, tcp:// and rdma:// clients get what
/// they ask for, and both ends agree on the transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_picks_rdma_against_rdma_peer() {
    within(LIMIT, "auto picks rdma", async {
        if common::iwarp() {
            // iWARP's listener is a TCP listener: no port serves both.
            let err = Listener::bind(format!("auto://{IP}:0")).await.unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::Unsupported, "{err}");
            assert!(
                matches!(
                    tokio_rdma::Error::from_io(&err),
                    Some(tokio_rdma::Error::AutoPortOnIwarp { addr }) if *addr == format!("auto://{IP}:0")
                ),
                "{err:?}"
            );
            return;
        }
        let listener = Listener::bind(format!("auto://{IP}:0")).await.unwrap();
        assert!(listener.serves(Transport::Auto));
        let port = listener.local_addr().unwrap().port();
        assert_ne!(port, 0);
        assert_eq!(listener.rdma_local_addr().unwrap().port(), port);
        for (scheme, want) in [
            ("auto", Transport::Rdma),
            ("tcp", Transport::Tcp),
            ("rdma", Transport::Rdma),
            ("auto", Transport::Rdma),
        ] {
            let addr: TransportAddr = format!("{scheme}://{IP}:{port}").parse().unwrap();
            let got = transport_suite::round_trip(&listener, &addr, b"auto picks").await;
            assert_eq!(got, (want, want), "{scheme}://");
        }
    })
    .await;
}

/// An `rdma://` listener is not reachable over TCP and vice versa; an auto
/// client reaches an rdma-only listener over RDMA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_client_against_rdma_only_listener() {
    within(LIMIT, "auto vs rdma-only", async {
        let listener = Listener::bind(format!("rdma://{IP}:0")).await.unwrap();
        assert!(listener.serves(Transport::Rdma));
        assert!(!listener.serves(Transport::Tcp));
        let port = listener.local_addr().unwrap().port();
        let addr: TransportAddr = format!("auto://{IP}:{port}").parse().unwrap();
        let got = transport_suite::round_trip(&listener, &addr, b"rdma only").await;
        assert_eq!(got, (Transport::Rdma, Transport::Rdma));
    })
    .await;
}

/// A misconfiguration is an error, not a silent fallback: an `auto://`
/// client whose `RdmaConfig::device` names no device gets `NotFound`
/// (`DeviceNotFound`) although the peer serves TCP too, and nothing is
/// counted as a fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_with_a_wrong_device_is_an_error_not_a_fallback() {
    within(LIMIT, "auto wrong device", async {
        // A peer that serves TCP too (over iWARP, which cannot share a
        // port between the two, a TCP listener).
        let scheme = if common::iwarp() { "tcp" } else { "auto" };
        let listener = Listener::bind(format!("{scheme}://{IP}:0")).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let before = tokio_rdma::transport::fallback_count();
        let cfg = tokio_rdma::RdmaConfig::new().device("mlx5_99");
        let err = tokio_rdma::transport::Stream::connect_with(format!("auto://{IP}:{port}"), &cfg)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
        assert!(
            matches!(
                tokio_rdma::Error::from_io(&err),
                Some(tokio_rdma::Error::DeviceNotFound { name }) if name == "mlx5_99"
            ),
            "{err:?}"
        );
        assert_eq!(tokio_rdma::transport::fallback_count(), before);
    })
    .await;
}

/// No RDMA device has a loopback address: `rdma://127.0.0.1` is refused at
/// bind, and `auto://127.0.0.1` serves TCP only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_auto_listener_serves_tcp_only() {
    within(LIMIT, "loopback", async {
        let err = Listener::bind("rdma://127.0.0.1:0").await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrNotAvailable, "{err}");
        let listener = Listener::bind("auto://127.0.0.1:0").await.unwrap();
        assert!(listener.serves(Transport::Tcp));
        assert!(!listener.serves(Transport::Rdma));
        assert!(listener.rdma_local_addr().is_none());
    })
    .await;
}
