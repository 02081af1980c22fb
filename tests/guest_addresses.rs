//! Guest tests of addressing on Soft-RoCE (rxe0 on veth0): IPv6 global and
//! link-local addresses, and a GID table that changes while the process
//! runs (an address removed from the netdev, then added back). Needs the
//! guest (`integration/softroce run -- ...`, as root: it changes veth0's
//! addresses); fails, never skips, without it.
//!
//! On RoCE every IP address of the netdev is a GID (IBTA vol. 1 annex
//! A17, RoCE v2), added and removed by the kernel as the address comes and
//! goes; rdma_cm resolves an IPv6 address, link-local ones with their
//! scope (the interface), like any other.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it).
#![cfg(tokio_rdma_guest)]

use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::verbs::{self, GidType};
use tokio_rdma::{Error, MessageEndpoint, MessageListener, RdmaListener, RdmaStream};

mod common;

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

/// The netdev rxe0 is bound to (integration/softroce).
const NETDEV: &str = "veth0";
/// A unique-local address the test adds to it.
const GLOBAL: &str = "fd00:11::1";

fn ip_cmd(args: &[&str]) {
    let status = std::process::Command::new("ip")
        .args(args)
        .status()
        .expect("run ip");
    assert!(status.success(), "ip {args:?}: {status}");
}

fn ip_out(args: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("run ip");
    assert!(out.status.success(), "ip {args:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Whether any port of the guest's device has `gid` in its GID table now.
fn has_gid(gid: Ipv6Addr) -> bool {
    verbs::devices()
        .expect("devices")
        .iter()
        .filter(|d| d.name == common::device())
        .flat_map(|d| &d.ports)
        .flat_map(|p| &p.gids)
        .any(|g| g.gid == gid)
}

/// Waits (up to 10 s) until `gid` is, or is no longer, in the GID table:
/// the kernel updates it from a work queue after the address changes.
async fn wait_gid(gid: Ipv6Addr, present: bool) {
    let t0 = Instant::now();
    while has_gid(gid) != present {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "GID {gid} still {} after 10 s",
            if present { "missing" } else { "present" }
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Adds [`GLOBAL`] to veth0 (no duplicate address detection) and waits
/// until it is the GID `global`.
async fn add_global(global: Ipv6Addr) {
    ip_cmd(&[
        "-6",
        "addr",
        "add",
        &format!("{GLOBAL}/64"),
        "dev",
        NETDEV,
        "nodad",
    ]);
    wait_gid(global, true).await;
}

/// veth0's link-local address once it passed duplicate address detection.
async fn link_local() -> Ipv6Addr {
    let t0 = Instant::now();
    loop {
        let out = ip_out(&["-6", "-o", "addr", "show", "dev", NETDEV, "scope", "link"]);
        if !out.contains("tentative") {
            if let Some(addr) = out.split_whitespace().skip_while(|w| *w != "inet6").nth(1) {
                let ip = addr.split('/').next().unwrap();
                return ip.parse().expect("a link-local address");
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no usable link-local address on {NETDEV}: {out}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ifindex(netdev: &str) -> u32 {
    std::fs::read_to_string(format!("/sys/class/net/{netdev}/ifindex"))
        .expect("ifindex")
        .trim()
        .parse()
        .unwrap()
}

/// A stream and a message endpoint connected over `addr` (a listener
/// bound there, port 0): both ends see the addresses, 256 KiB echo back
/// exact and a message arrives exact.
async fn connects_over(addr: SocketAddr) {
    let l = RdmaListener::bind(addr).await.expect("bind");
    let bound = l.local_addr().unwrap();
    assert_eq!(bound.ip(), addr.ip());
    let (c, s) = tokio::join!(RdmaStream::connect(bound), l.accept());
    let mut c = c.expect("connect");
    let (s, peer) = s.expect("accept");
    assert_eq!(c.peer_addr().unwrap(), bound);
    assert_eq!(peer.ip(), addr.ip());
    let echo = tokio::spawn(common::echo(s));
    let data = shared::pattern_vec(7, 256 * 1024);
    let (mut r, mut w) = c.split();
    let (wrote, back) = tokio::join!(w.write_all(&data), async {
        let mut back = vec![0u8; data.len()];
        r.read_exact(&mut back).await.map(|_| back)
    });
    wrote.expect("write");
    assert!(back.expect("read the echo") == data, "echo over {addr}");
    c.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).await.expect("EOF");
    assert_eq!(echo.await.unwrap().expect("echo"), data.len() as u64);

    let ml = MessageListener::bind(addr).await.expect("bind");
    let bound = ml.local_addr().unwrap();
    let (c, s) = tokio::join!(MessageEndpoint::connect(bound), ml.accept());
    let (c, s) = (c.expect("connect"), s.expect("accept").0);
    c.send_copy(b"over IPv6").await.expect("send");
    assert_eq!(
        &s.recv().await.expect("recv").expect("a message")[..],
        b"over IPv6"
    );
}

/// IPv6: a global (unique-local) address added to the netdev becomes a
/// RoCE v2 GID and carries streams and messages; so does the link-local
/// address with its scope. Removed while the process runs, the address's
/// GID goes, `select_device` says no device has it, and binding or
/// connecting to it fails at once with a typed error naming it; added
/// back, it works again in the same process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_global_and_link_local_addresses_work_and_follow_the_gid_table() {
    let global: Ipv6Addr = GLOBAL.parse().unwrap();
    add_global(global).await;
    let sel = verbs::select_device(IpAddr::V6(global)).expect("a device for the address");
    assert_eq!(
        (sel.device.as_str(), sel.gid, sel.gid_type),
        (common::device().as_str(), global, GidType::RoceV2)
    );
    connects_over(SocketAddr::new(IpAddr::V6(global), 0)).await;

    let ll = link_local().await;
    wait_gid(ll, true).await;
    let sel = verbs::select_device(IpAddr::V6(ll)).expect("a device for the link-local address");
    assert_eq!((sel.gid, sel.gid_type), (ll, GidType::RoceV2));
    connects_over(SocketAddr::V6(SocketAddrV6::new(ll, 0, 0, ifindex(NETDEV)))).await;

    // The address goes while the process runs.
    let l = RdmaListener::bind(SocketAddr::new(IpAddr::V6(global), 0))
        .await
        .expect("bind before the address goes");
    let port = l.local_addr().unwrap().port();
    drop(l);
    ip_cmd(&["-6", "addr", "del", &format!("{GLOBAL}/64"), "dev", NETDEV]);
    wait_gid(global, false).await;
    match verbs::select_device(IpAddr::V6(global)) {
        Err(Error::NoDeviceForAddress { addr }) => assert_eq!(addr, IpAddr::V6(global)),
        r => panic!("expected NoDeviceForAddress, got {r:?}"),
    }
    let gone = SocketAddr::new(IpAddr::V6(global), port);
    let t0 = Instant::now();
    let e = RdmaListener::bind(gone).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AddrNotAvailable, "{e}");
    assert!(
        matches!(Error::from_io(&e), Some(Error::NoDeviceForAddress { addr }) if *addr == gone.ip()),
        "{e:?}"
    );
    // Its prefix route went with it: no route, at once.
    let e = RdmaStream::connect(gone).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::NetworkUnreachable, "{e}");
    assert!(
        matches!(Error::from_io(&e), Some(Error::Unreachable { addr, .. }) if *addr == gone),
        "{e:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "failed fast, not after the connect timeout"
    );

    // Back again: the same process binds and connects over it.
    add_global(global).await;
    connects_over(SocketAddr::new(IpAddr::V6(global), 0)).await;
    ip_cmd(&["-6", "addr", "del", &format!("{GLOBAL}/64"), "dev", NETDEV]);
}
