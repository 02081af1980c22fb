//! Lists the RDMA devices, their ports and GID tables, like a short
//! `ibv_devinfo -v` plus rdma-core's `show_gids`.
//!
//! ```text
//! cargo run --example devices            # every device
//! cargo run --example devices -- 10.11.0.1   # also pick the GID for an address
//! ```

use std::net::IpAddr;
use std::process::ExitCode;

use clap::Parser;
use tokio_rdma::verbs;

/// List RDMA devices, ports and GIDs.
#[derive(Parser)]
struct Args {
    /// Also select the device/port/GID that serves this local IP address.
    addr: Option<IpAddr>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let devices = match verbs::devices() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    for dev in &devices {
        println!(
            "{}  node_guid {}  fw {:?}",
            dev.name,
            dev.node_guid_string(),
            dev.firmware
        );
        for p in &dev.ports {
            println!(
                "  port {}: {}  link {}  mtu {} (max {})  lid {}",
                p.port_num, p.state, p.link_layer, p.active_mtu, p.max_mtu, p.lid
            );
            for g in &p.gids {
                let ip = g.ip.map_or_else(|| "-".to_string(), |ip| ip.to_string());
                let nd = g.netdev.as_deref().unwrap_or("-");
                println!(
                    "    gid[{:>2}] {:<40} {:<8} ip {:<16} netdev {}",
                    g.index,
                    g.gid.to_string(),
                    g.gid_type.to_string(),
                    ip,
                    nd
                );
            }
        }
    }
    if let Some(addr) = args.addr {
        match verbs::device::select_from(&devices, addr) {
            Ok(a) => println!(
                "{addr} -> {} port {} gid[{}] {} ({})",
                a.device, a.port_num, a.gid_index, a.gid, a.gid_type
            ),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
