//! Guest test (needs the Soft-RoCE guest: `integration/softroce run --
//! integration/guest-suite`). Fails, never skips, without a device.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it), so
//! host builds (`cargo test --all-features` included) leave it empty.
#![cfg(tokio_rdma_guest)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;

use tokio_rdma::verbs::{self, GidType, LinkLayer, PortState};

const GUEST_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 11, 0, 1));

#[test]
fn listing_finds_rxe0_active_with_roce_v2_gid_for_guest_ip() {
    let devices = verbs::devices().expect("the Soft-RoCE guest must have an RDMA device");
    let rxe = devices
        .iter()
        .find(|d| d.name == "rxe0")
        .unwrap_or_else(|| panic!("rxe0 not listed; got {devices:?}"));
    assert_eq!(rxe.ports.len(), 1);
    let port = &rxe.ports[0];
    assert_eq!(port.port_num, 1);
    assert_eq!(port.state, PortState::Active);
    assert_eq!(port.link_layer, LinkLayer::Ethernet);
    let v2: Vec<_> = port
        .gids
        .iter()
        .filter(|g| g.ip == Some(GUEST_IP))
        .collect();
    assert_eq!(
        v2.len(),
        1,
        "exactly one GID maps 10.11.0.1: {:?}",
        port.gids
    );
    assert_eq!(v2[0].gid_type, GidType::RoceV2);
    assert_eq!(v2[0].gid, Ipv4Addr::new(10, 11, 0, 1).to_ipv6_mapped());
    assert_eq!(v2[0].netdev.as_deref(), Some("veth0"));
}

#[test]
fn selecting_guest_ip_returns_rxe0_and_that_gid_index() {
    let devices = verbs::devices().expect("device listing");
    let expected_index = devices
        .iter()
        .find(|d| d.name == "rxe0")
        .and_then(|d| d.ports[0].gids.iter().find(|g| g.ip == Some(GUEST_IP)))
        .map(|g| g.index)
        .expect("rxe0 has a GID for 10.11.0.1");
    let sel = verbs::select_device(GUEST_IP).expect("select rxe0 for 10.11.0.1");
    assert_eq!(sel.device, "rxe0");
    assert_eq!(sel.port_num, 1);
    assert_eq!(sel.gid_index, expected_index);
    assert_eq!(sel.gid_type, GidType::RoceV2);
    // The GID index agrees with rdma-core's own sysfs view.
    let sysfs = std::fs::read_to_string(format!(
        "/sys/class/infiniband/rxe0/ports/1/gids/{}",
        sel.gid_index
    ))
    .expect("sysfs gid entry");
    let sysfs_gid: Ipv6Addr = sysfs.trim().parse().expect("sysfs GID parses as IPv6");
    assert_eq!(sysfs_gid, sel.gid);
    let other = IpAddr::V4(Ipv4Addr::new(10, 11, 0, 2));
    match verbs::select_device(other) {
        Err(tokio_rdma::Error::NoDeviceForAddress { addr }) => assert_eq!(addr, other),
        r => panic!("expected NoDeviceForAddress, got {r:?}"),
    }
}

#[test]
fn node_guid_matches_ibv_devinfo() {
    let devices = verbs::devices().expect("device listing");
    let rxe = devices.iter().find(|d| d.name == "rxe0").expect("rxe0");
    let out = Command::new("ibv_devinfo")
        .args(["-d", "rxe0"])
        .output()
        .expect("ibv_devinfo runs in the guest");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("node_guid:"))
        .unwrap_or_else(|| panic!("no node_guid in ibv_devinfo output: {text}"));
    let guid = line.split_whitespace().last().unwrap();
    assert_eq!(guid, rxe.node_guid_string());
}
