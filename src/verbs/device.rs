//! Device discovery: devices, ports, GID tables, and choosing the
//! device/port/GID that serves a local IP address.
//!
//! The listing mirrors what `ibv_devinfo -v` and `show_gids` (rdma-core)
//! print. Choosing a GID for an IP address follows the RoCE convention (IBTA
//! RoCE v2 annex A17): a RoCE GID is the IPv6 address of the Ethernet
//! interface, with IPv4 addresses stored IPv4-mapped (`::ffff:a.b.c.d`).

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv6Addr};

use sideway::ibverbs::address::GidType as SwGidType;
use sideway::ibverbs::device::{
    DeviceInfo as _, DeviceList, GetDeviceListErrorKind, TransportType,
};
use sideway::ibverbs::device_context::{LinkLayer as SwLinkLayer, PortState as SwPortState};

use crate::error::{Error, Result};

/// The wire format a GID is used with (`ibv_gid_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GidType {
    /// Native InfiniBand: the GID is subnet prefix + port GUID; no IP address.
    InfiniBand,
    /// RoCE v1: Ethernet frames (ethertype 0x8915), not routable.
    RoceV1,
    /// RoCE v2: UDP/IP (destination port 4791), routable. Preferred.
    RoceV2,
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidType::InfiniBand => "IB",
            GidType::RoceV1 => "RoCE v1",
            GidType::RoceV2 => "RoCE v2",
        })
    }
}

/// Logical state of a port (`ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PortState {
    /// The link is down.
    Down,
    /// The link is up, waiting for the subnet manager.
    Init,
    /// Configured by the subnet manager, not yet active.
    Armed,
    /// Passing traffic. The only state a connection can use.
    Active,
    /// Active, recovering from a physical link failure.
    ActiveDefer,
    /// A value libibverbs documents as reserved.
    Nop,
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PortState::Down => "DOWN",
            PortState::Init => "INIT",
            PortState::Armed => "ARMED",
            PortState::Active => "ACTIVE",
            PortState::ActiveDefer => "ACTIVE_DEFER",
            PortState::Nop => "NOP",
        })
    }
}

/// Link layer of a port (`ibv_port_attr::link_layer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE, including Soft-RoCE `rdma_rxe`).
    Ethernet,
    /// Not reported by the driver (treated as InfiniBand by libibverbs).
    Unspecified,
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::Unspecified => "unspecified",
        })
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Gid {
    /// Index in the port's GID table (what `ib_write_bw -x N` takes).
    pub index: u32,
    /// The 128-bit GID, shown as an IPv6 address.
    pub gid: Ipv6Addr,
    /// Wire format used with this GID.
    pub gid_type: GidType,
    /// The IP address this GID maps: `Some` for RoCE GIDs (IPv4-mapped GIDs
    /// become [`IpAddr::V4`]), `None` for InfiniBand GIDs.
    pub ip: Option<IpAddr>,
    /// Name of the Ethernet interface behind a RoCE GID, for example `veth0`.
    pub netdev: Option<String>,
}

/// One physical port of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Port {
    /// Port number, starting at 1.
    pub port_num: u8,
    /// Logical state.
    pub state: PortState,
    /// Active path MTU in bytes (256..=4096), the RDMA payload per packet.
    pub active_mtu: u32,
    /// Largest MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Local identifier (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// The populated entries of the GID table, in index order.
    pub gids: Vec<Gid>,
}

/// The RDMA transport a device speaks (`ibv_device::transport_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RdmaTransport {
    /// InfiniBand's transport: InfiniBand and RoCE (v1, v2) devices,
    /// Soft-RoCE (`rdma_rxe`) included. Immediate data, memory windows
    /// (where the device has them), atomics (where `atomic_cap` allows).
    InfiniBand,
    /// iWARP (RDMA over TCP, RFC 5040/5041/5044): Chelsio T5/T6, Intel
    /// E810 in iWARP mode, Soft-iWARP (`siw`). No immediate data; the
    /// connection is a TCP connection, in TCP's port space.
    Iwarp,
    /// Another transport libibverbs reports (usNIC, unknown), with its
    /// `ibv_transport_type` value.
    Other(i32),
}

impl fmt::Display for RdmaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RdmaTransport::InfiniBand => f.write_str("InfiniBand"),
            RdmaTransport::Iwarp => f.write_str("iWARP"),
            RdmaTransport::Other(t) => write!(f, "transport {t}"),
        }
    }
}

/// An RDMA device (HCA/RNIC) with its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Device {
    /// Device name, for example `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID (64 bits), as `ibv_devinfo` prints it (`xxxx:xxxx:xxxx:xxxx`
    /// via [`Device::node_guid_string`]).
    pub node_guid: u64,
    /// Firmware version string as reported by the driver (may be empty).
    pub firmware: String,
    /// The transport it speaks: InfiniBand (also RoCE) or iWARP.
    pub transport: RdmaTransport,
    /// Physical ports, in port-number order.
    pub ports: Vec<Port>,
}

impl Device {
    /// The node GUID formatted like `ibv_devinfo`: four groups of four hex
    /// digits separated by colons.
    pub fn node_guid_string(&self) -> String {
        let g = self.node_guid;
        format!(
            "{:04x}:{:04x}:{:04x}:{:04x}",
            (g >> 48) & 0xffff,
            (g >> 32) & 0xffff,
            (g >> 16) & 0xffff,
            g & 0xffff
        )
    }
}

/// The device, port and GID that serve one local IP address: what a queue
/// pair needs to be created and addressed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAddress {
    /// Device name, for example `rxe0`.
    pub device: String,
    /// Port number (1-based).
    pub port_num: u8,
    /// GID table index on that port.
    pub gid_index: u32,
    /// Type of the chosen GID (RoCE v2 when the address has one).
    pub gid_type: GidType,
    /// The GID itself.
    pub gid: Ipv6Addr,
}

/// Maps a RoCE GID to the IP address it carries: IPv4-mapped GIDs
/// (`::ffff:a.b.c.d`) give IPv4, others IPv6.
pub(crate) fn gid_to_ip(gid: Ipv6Addr) -> IpAddr {
    match gid.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(gid),
    }
}

pub(crate) fn mtu_bytes(mtu: sideway::ibverbs::device_context::Mtu) -> u32 {
    use sideway::ibverbs::device_context::Mtu;
    match mtu {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

fn open_device_list() -> Result<DeviceList> {
    match DeviceList::new() {
        Ok(list) => Ok(list),
        Err(err) => {
            let source = match err.0 {
                GetDeviceListErrorKind::Ibverbs(source) => source,
                other => io::Error::other(other.to_string()),
            };
            Err(match source.raw_os_error() {
                // rdma-mummy-sys answers EOPNOTSUPP when dlopen("libibverbs.so.1")
                // failed and the symbol was never loaded.
                Some(libc::EOPNOTSUPP) => Error::LibraryUnavailable {
                    library: "libibverbs.so.1",
                },
                // libibverbs answers ENOSYS when the kernel has no uverbs
                // support at all: no device can exist.
                Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) => Error::NoDevice,
                _ => Error::Verbs {
                    op: "ibv_get_device_list",
                    source,
                },
            })
        }
    }
}

fn verbs_err(op: &'static str) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> Error {
    move |e| Error::Verbs {
        op,
        source: io::Error::other(e),
    }
}

/// A device was found before in this process ([`ensure_present`]).
static PRESENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Fails fast with the typed error of [`devices`] on a host without RDMA;
/// once a device was found, returns at once. The first call loads
/// libibverbs' providers and opens and queries every device: milliseconds
/// on a host, seconds in the emulated test bed (whose guest reads every
/// library over 9p), where 40 fresh processes' first connects spent
/// 1.4-2.9 s here; each connect and bind used to pay a full enumeration
/// (0.4-0.5 ms of a 2 ms connect in the deterministic guest).
pub(crate) fn ensure_present() -> Result<(), Error> {
    use std::sync::atomic::Ordering;
    if PRESENT.load(Ordering::Acquire) {
        return Ok(());
    }
    devices()?;
    PRESENT.store(true, Ordering::Release);
    Ok(())
}

/// Whether [`ensure_present`] found a device before.
pub(crate) fn known_present() -> bool {
    PRESENT.load(std::sync::atomic::Ordering::Acquire)
}

/// Lists every RDMA device with its ports and populated GID entries.
///
/// # Errors
/// - [`Error::LibraryUnavailable`] when libibverbs cannot be loaded;
/// - [`Error::NoDevice`] when it loads but reports no device;
/// - [`Error::Verbs`] when opening or querying a device fails.
pub fn devices() -> Result<Vec<Device>, Error> {
    let list = open_device_list()?;
    if list.is_empty() {
        return Err(Error::NoDevice);
    }
    let mut out = Vec::with_capacity(list.len());
    for dev in list.iter() {
        let name = dev.name();
        let ctx = dev
            .open()
            .map_err(|e| verbs_err("ibv_open_device")(e.into()))?;
        let attr = ctx
            .query_device()
            .map_err(|e| verbs_err("ibv_query_device_ex")(e.into()))?;
        let table = ctx
            .query_gid_table()
            .map_err(|e| verbs_err("ibv_query_gid_table")(e.into()))?;
        let mut ports = Vec::new();
        for port_num in 1..=attr.phys_port_cnt() {
            let pa = ctx
                .query_port(port_num)
                .map_err(|e| verbs_err("ibv_query_port")(e.into()))?;
            let link_layer = match pa.link_layer() {
                SwLinkLayer::InfiniBand => LinkLayer::InfiniBand,
                SwLinkLayer::Ethernet => LinkLayer::Ethernet,
                SwLinkLayer::Unspecified => LinkLayer::Unspecified,
            };
            let state = match pa.port_state() {
                SwPortState::Down => PortState::Down,
                SwPortState::Initializing => PortState::Init,
                SwPortState::Armed => PortState::Armed,
                SwPortState::Active => PortState::Active,
                SwPortState::ActiveDefer => PortState::ActiveDefer,
                SwPortState::Nop => PortState::Nop,
            };
            let mut gids: Vec<Gid> = table
                .iter()
                .filter(|e| e.port_num() == u32::from(port_num))
                .map(|e| {
                    let gid = Ipv6Addr::from(e.gid());
                    let gid_type = match e.gid_type() {
                        SwGidType::InfiniBand => GidType::InfiniBand,
                        SwGidType::RoceV1 => GidType::RoceV1,
                        SwGidType::RoceV2 => GidType::RoceV2,
                    };
                    let roce = gid_type != GidType::InfiniBand;
                    Gid {
                        index: e.gid_index(),
                        gid,
                        gid_type,
                        ip: roce.then(|| gid_to_ip(gid)),
                        netdev: if roce { e.netdev_name().ok() } else { None },
                    }
                })
                .collect();
            gids.sort_by_key(|g| g.index);
            ports.push(Port {
                port_num,
                state,
                active_mtu: mtu_bytes(pa.active_mtu()),
                max_mtu: mtu_bytes(pa.max_mtu()),
                link_layer,
                lid: pa.lid(),
                gids,
            });
        }
        out.push(Device {
            transport: match dev.transport_type() {
                TransportType::InfiniBand => RdmaTransport::InfiniBand,
                TransportType::IWarp => RdmaTransport::Iwarp,
                other => RdmaTransport::Other(other as i32),
            },
            name,
            node_guid: u64::from_be(attr.node_guid().as_u64()),
            firmware: attr.firmware_version(),
            ports,
        });
    }
    Ok(out)
}

/// Picks, among `devices`, the device/port/GID whose GID maps `ip`.
///
/// Only ACTIVE ports count. A RoCE v2 GID is preferred over RoCE v1 (v2 is
/// routable and what rdma_cm uses by default), then the lowest GID index.
///
/// # Errors
/// [`Error::NoDeviceForAddress`] when no active port has a GID for `ip`.
pub fn select_from(devices: &[Device], ip: IpAddr) -> Result<DeviceAddress, Error> {
    let ip = canonical(ip);
    let mut best: Option<(u8, DeviceAddress)> = None;
    for dev in devices {
        for port in dev.ports.iter().filter(|p| p.state == PortState::Active) {
            for gid in &port.gids {
                if gid.ip.map(canonical) != Some(ip) {
                    continue;
                }
                let rank = match gid.gid_type {
                    GidType::RoceV2 => 0,
                    GidType::RoceV1 => 1,
                    GidType::InfiniBand => 2,
                };
                if best.as_ref().is_none_or(|(r, _)| rank < *r) {
                    best = Some((
                        rank,
                        DeviceAddress {
                            device: dev.name.clone(),
                            port_num: port.port_num,
                            gid_index: gid.index,
                            gid_type: gid.gid_type,
                            gid: gid.gid,
                        },
                    ));
                }
            }
        }
    }
    best.map(|(_, a)| a)
        .ok_or(Error::NoDeviceForAddress { addr: ip })
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Lists the devices and picks the device/port/GID that serves local address
/// `ip` (see [`select_from`] for the rule). An iWARP device's GIDs carry
/// its MAC address, not an IP address, so when no GID maps `ip` and an
/// iWARP device is present, rdma_cm decides as it does for a connect or a
/// listener: an id bound to `ip` (`rdma_bind_addr`, port 0, released at
/// once) names the device and port whose network device has the address;
/// the port's first GID is returned.
///
/// # Errors
/// Those of [`devices`], and [`Error::NoDeviceForAddress`] when no device
/// serves `ip`.
pub fn select_device(ip: IpAddr) -> Result<DeviceAddress, Error> {
    select_among(&devices()?, ip)
}

/// [`select_device`] over a device list already read.
pub(crate) fn select_among(devices: &[Device], ip: IpAddr) -> Result<DeviceAddress, Error> {
    match select_from(devices, ip) {
        Err(Error::NoDeviceForAddress { .. })
            if devices.iter().any(|d| d.transport == RdmaTransport::Iwarp) =>
        {
            select_bound(devices, ip)
        }
        r => r,
    }
}

/// The device and port rdma_cm binds `ip` to, if that is an iWARP device
/// among `devices` (a RoCE or InfiniBand device would have had a GID for
/// `ip`: [`select_from`]).
fn select_bound(devices: &[Device], ip: IpAddr) -> Result<DeviceAddress, Error> {
    let none = || Error::NoDeviceForAddress {
        addr: canonical(ip),
    };
    let id = super::cm::CmId::new_shared()?;
    id.bind(std::net::SocketAddr::new(ip, 0))
        .map_err(|_| none())?;
    let (name, port_num) = (id.device_name().ok_or_else(none)?, id.port_num());
    drop(id);
    let dev = devices
        .iter()
        .find(|d| d.name == name && d.transport == RdmaTransport::Iwarp)
        .ok_or_else(none)?;
    let port = dev
        .ports
        .iter()
        .find(|p| p.port_num == port_num && p.state == PortState::Active)
        .ok_or_else(none)?;
    let gid = port.gids.first().ok_or_else(none)?;
    Ok(DeviceAddress {
        device: dev.name.clone(),
        port_num,
        gid_index: gid.index,
        gid_type: gid.gid_type,
        gid: gid.gid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn gid(index: u32, gid_type: GidType, ip: IpAddr) -> Gid {
        let g = match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        Gid {
            index,
            gid: g,
            gid_type,
            ip: Some(ip),
            netdev: Some("veth0".into()),
        }
    }

    fn rxe(state: PortState) -> Device {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 11, 0, 1));
        let ll: IpAddr = "fe80::1".parse().unwrap();
        Device {
            name: "rxe0".into(),
            node_guid: 0x0200_5eff_fe00_0001,
            firmware: String::new(),
            transport: RdmaTransport::InfiniBand,
            ports: vec![Port {
                port_num: 1,
                state,
                active_mtu: 1024,
                max_mtu: 4096,
                link_layer: LinkLayer::Ethernet,
                lid: 0,
                gids: vec![
                    gid(0, GidType::RoceV1, ll),
                    gid(1, GidType::RoceV2, ll),
                    gid(2, GidType::RoceV1, v4),
                    gid(3, GidType::RoceV2, v4),
                ],
            }],
        }
    }

    #[test]
    fn selects_roce_v2_gid_for_ipv4() {
        let a = select_from(&[rxe(PortState::Active)], "10.11.0.1".parse().unwrap()).unwrap();
        assert_eq!(a.device, "rxe0");
        assert_eq!(a.port_num, 1);
        assert_eq!(a.gid_index, 3);
        assert_eq!(a.gid_type, GidType::RoceV2);
        assert_eq!(a.gid, "::ffff:10.11.0.1".parse::<Ipv6Addr>().unwrap());
        // The IPv4-mapped IPv6 spelling selects the same GID.
        let b = select_from(
            &[rxe(PortState::Active)],
            "::ffff:10.11.0.1".parse().unwrap(),
        )
        .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn selects_link_local_v6() {
        let a = select_from(&[rxe(PortState::Active)], "fe80::1".parse().unwrap()).unwrap();
        assert_eq!(a.gid_index, 1);
    }

    #[test]
    fn inactive_port_or_unknown_ip_is_typed_error() {
        let ip: IpAddr = "10.11.0.1".parse().unwrap();
        match select_from(&[rxe(PortState::Down)], ip) {
            Err(Error::NoDeviceForAddress { addr }) => assert_eq!(addr, ip),
            other => panic!("unexpected {other:?}"),
        }
        let other: IpAddr = "10.11.0.2".parse().unwrap();
        assert!(matches!(
            select_from(&[rxe(PortState::Active)], other),
            Err(Error::NoDeviceForAddress { addr }) if addr == other
        ));
    }

    #[test]
    fn gid_ip_mapping_and_guid_format() {
        assert_eq!(
            gid_to_ip("::ffff:10.11.0.1".parse().unwrap()),
            IpAddr::V4(Ipv4Addr::new(10, 11, 0, 1))
        );
        assert_eq!(
            gid_to_ip("fe80::1".parse().unwrap()),
            "fe80::1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            rxe(PortState::Active).node_guid_string(),
            "0200:5eff:fe00:0001"
        );
    }
}
