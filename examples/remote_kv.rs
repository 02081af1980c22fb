//! A key-value store whose clients read values with one-sided RDMA READs
//! and bump per-key counters with fetch-and-add, while the server's CPU
//! stays idle, and put new values with `write_notify`: the server grants
//! two windows (the value table, read and write; the counters, atomics
//! only); gets never wake it, and each put's notification arrives once
//! the new value is in place. Its CPU time while serving gets and while
//! taking puts is printed.
//!
//! ```text
//! remote_kv server --addr 10.11.0.1:7490 [--keys 4096] [--value-len 256]
//! remote_kv client --addr 10.11.0.1:7490 [--gets 20000] [--puts 1000]
//! remote_kv demo   --addr 10.11.0.1:7490   # both, the server in a child process
//! ```
//!
//! The client checks every value byte for byte (key `k`'s value is the
//! pattern of seed `k`, and after its put that of seed `PUT_SEED + k`);
//! the server checks that the counters sum to the number of gets the
//! client reports, and that every put's notification names a key whose
//! slot holds the put value. Exit status 0 only if all hold.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use tokio_rdma::remote::{GrantAccess, LocalRegion, REMOTE_REGION_LEN, RemoteRegion};
use tokio_rdma::{Incoming, MessageEndpoint, MessageListener};

#[path = "shared/cpu.rs"]
mod cpu;
#[path = "shared/pattern.rs"]
#[allow(dead_code)]
mod pattern;

#[derive(Parser)]
#[command(about = "A key-value store served by one-sided RDMA READs and atomics")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serves one client: grants the tables, then waits for its close.
    Server {
        /// Address to bind (an RDMA device's IP address).
        #[arg(long)]
        addr: SocketAddr,
        /// Number of keys.
        #[arg(long, default_value_t = 4096)]
        keys: usize,
        /// Bytes per value.
        #[arg(long, default_value_t = 256)]
        value_len: usize,
    },
    /// Reads values and bumps counters.
    Client {
        /// The server's address.
        #[arg(long)]
        addr: SocketAddr,
        /// Gets (one READ and one fetch-and-add each).
        #[arg(long, default_value_t = 20_000)]
        gets: u64,
        /// Puts (one `write_notify` each), after the gets.
        #[arg(long, default_value_t = 1000)]
        puts: u64,
    },
    /// Runs the server in a child process and a client against it.
    Demo {
        /// Address for the server (an RDMA device's IP address).
        #[arg(long)]
        addr: SocketAddr,
        /// Gets of the client.
        #[arg(long, default_value_t = 20_000)]
        gets: u64,
        /// Puts of the client.
        #[arg(long, default_value_t = 1000)]
        puts: u64,
    },
}

/// A put of key `k` writes the pattern of seed `PUT_SEED + k`.
const PUT_SEED: u64 = 1 << 32;

/// The key of put `i` (spread over the keys).
fn put_key(i: u64, keys: u64) -> u64 {
    i.wrapping_mul(31) % keys
}

/// What the server sends first: the value table's grant, the counters'
/// grant, then keys and value length as two little-endian u64.
const HELLO_LEN: usize = 2 * REMOTE_REGION_LEN + 16;

async fn server(addr: SocketAddr, keys: usize, value_len: usize) -> Result<(), String> {
    let listener = MessageListener::bind(addr)
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    println!(
        "listening on {}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    let (ep, peer) = listener
        .accept()
        .await
        .map_err(|e| format!("accept: {e}"))?;
    let pool = ep.pool().clone();
    let values = LocalRegion::new(
        pool.alloc_any(keys * value_len)
            .await
            .map_err(|e| e.to_string())?,
    );
    for k in 0..keys {
        values
            .write_at(k * value_len, &pattern::pattern_vec(k as u64, value_len))
            .map_err(|e| e.to_string())?;
    }
    let counters = LocalRegion::new(pool.alloc_any(keys * 8).await.map_err(|e| e.to_string())?);
    counters
        .write_at(0, &vec![0u8; keys * 8])
        .map_err(|e| e.to_string())?;
    let vg = ep
        .grant(
            &values,
            0..keys * value_len,
            GrantAccess::READ | GrantAccess::WRITE,
        )
        .await
        .map_err(|e| format!("grant values: {e}"))?;
    let cg = ep
        .grant(&counters, 0..keys * 8, GrantAccess::ATOMIC)
        .await
        .map_err(|e| format!("grant counters: {e}"))?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&vg.remote().encode());
    hello.extend_from_slice(&cg.remote().encode());
    hello.extend_from_slice(&(keys as u64).to_le_bytes());
    hello.extend_from_slice(&(value_len as u64).to_le_bytes());
    let cpu0 = cpu::cpu_us();
    let t0 = Instant::now();
    ep.send_copy(&hello).await.map_err(|e| e.to_string())?;
    // Nothing to do during the gets; each put wakes the server with its
    // notification, once the new value is in place; the client's count
    // ends it.
    let mut gets_cpu = None;
    let mut puts = 0u64;
    let done = loop {
        match ep.recv_incoming().await.map_err(|e| format!("recv: {e}"))? {
            Some(Incoming::Notification(n)) => {
                gets_cpu.get_or_insert_with(|| (cpu::cpu_us() - cpu0, t0.elapsed()));
                let k = n.value as usize;
                if k >= keys || n.len as usize != value_len {
                    return Err(format!("a put of {} bytes to key {k}", n.len));
                }
                let mut slot = vec![0u8; value_len];
                values
                    .read_at(k * value_len, &mut slot)
                    .map_err(|e| e.to_string())?;
                if slot != pattern::pattern_vec(PUT_SEED + k as u64, value_len) {
                    return Err(format!("key {k}: the put value is not in place"));
                }
                puts += 1;
            }
            Some(Incoming::Message(m)) => break m,
            None => return Err("the client closed without its count".into()),
        }
    };
    let cpu = cpu::cpu_us() - cpu0;
    let wall = t0.elapsed();
    let (gets_cpu, gets_wall) = gets_cpu.unwrap_or((cpu, wall));
    if done.len() != 16 {
        return Err(format!("a count of {} bytes", done.len()));
    }
    let gets = u64::from_le_bytes(done[..8].try_into().map_err(|_| "short count")?);
    let client_puts = u64::from_le_bytes(done[8..16].try_into().map_err(|_| "short count")?);
    let mut sum = 0u64;
    for k in 0..keys {
        sum += counters.load_u64(k * 8).map_err(|e| e.to_string())?;
    }
    println!(
        "server: {gets} gets from {peer} in {:.2} s; server CPU {:.3} s ({:.2} us per get, /proc/self/stat in 10 ms ticks)",
        gets_wall.as_secs_f64(),
        gets_cpu as f64 / 1e6,
        gets_cpu as f64 / gets.max(1) as f64
    );
    println!(
        "server: {puts} puts taken, each checked in place; server CPU {:.3} s for them ({:.2} us per put)",
        (cpu - gets_cpu) as f64 / 1e6,
        (cpu - gets_cpu) as f64 / puts.max(1) as f64
    );
    println!("server: counters sum to {sum}");
    vg.revoke().await.map_err(|e| format!("revoke: {e}"))?;
    cg.revoke().await.map_err(|e| format!("revoke: {e}"))?;
    if sum != gets {
        return Err(format!(
            "counters sum to {sum}, the client made {gets} gets"
        ));
    }
    if puts != client_puts {
        return Err(format!(
            "{puts} put notifications, the client made {client_puts} puts"
        ));
    }
    Ok(())
}

async fn client(addr: SocketAddr, gets: u64, puts: u64) -> Result<(), String> {
    let ep = MessageEndpoint::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let hello = ep
        .recv()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no grants")?;
    if hello.len() != HELLO_LEN {
        return Err(format!("hello of {} bytes", hello.len()));
    }
    let values = RemoteRegion::decode(&hello[..24]).map_err(|e| e.to_string())?;
    let counters = RemoteRegion::decode(&hello[24..48]).map_err(|e| e.to_string())?;
    let keys = u64::from_le_bytes(hello[48..56].try_into().unwrap());
    let value_len = u64::from_le_bytes(hello[56..64].try_into().unwrap());
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let cpu0 = cpu::cpu_us();
    let t0 = Instant::now();
    for i in 0..gets {
        let k = i.wrapping_mul(7919) % keys;
        let t = Instant::now();
        let v = ep
            .read(&values, k * value_len, value_len as usize)
            .await
            .map_err(|e| format!("get {k}: {e}"))?;
        ep.fetch_add(&counters, k * 8, 1)
            .await
            .map_err(|e| format!("count {k}: {e}"))?;
        hist.record(t.elapsed().as_nanos() as u64).ok();
        if v[..] != pattern::pattern_vec(k, value_len as usize)[..] {
            return Err(format!("key {k}: wrong value"));
        }
    }
    let wall = t0.elapsed();
    let cpu = cpu::cpu_us() - cpu0;
    println!(
        "client: {gets} gets (READ {value_len} B + fetch-and-add) in {:.2} s: {:.0} gets/s; per get p50 {:.1} us, mean {:.1} us, p99 {:.1} us; client CPU {:.2} us per get",
        wall.as_secs_f64(),
        gets as f64 / wall.as_secs_f64(),
        hist.value_at_quantile(0.5) as f64 / 1e3,
        hist.mean() / 1e3,
        hist.value_at_quantile(0.99) as f64 / 1e3,
        cpu as f64 / gets.max(1) as f64
    );
    // Puts: the new value lands in the server's table and the server is
    // told, in order with this client's messages.
    let t0 = Instant::now();
    for i in 0..puts {
        let k = put_key(i, keys);
        let v = pattern::pattern_vec(PUT_SEED + k, value_len as usize);
        ep.write_notify(&values, k * value_len, &v, k as u32)
            .await
            .map_err(|e| format!("put {k}: {e}"))?;
    }
    ep.flush().await.map_err(|e| e.to_string())?;
    let put_wall = t0.elapsed();
    for i in 0..puts.min(keys) {
        let k = put_key(i, keys);
        let v = ep
            .read(&values, k * value_len, value_len as usize)
            .await
            .map_err(|e| format!("get {k} after its put: {e}"))?;
        if v[..] != pattern::pattern_vec(PUT_SEED + k, value_len as usize)[..] {
            return Err(format!("key {k}: the put value did not land"));
        }
    }
    println!(
        "client: {puts} puts (write_notify of {value_len} B) in {:.2} s, read back equal",
        put_wall.as_secs_f64()
    );
    let mut count = gets.to_le_bytes().to_vec();
    count.extend_from_slice(&puts.to_le_bytes());
    ep.send_copy(&count).await.map_err(|e| e.to_string())?;
    ep.flush().await.map_err(|e| e.to_string())?;
    ep.close().await.map_err(|e| e.to_string())?;
    Ok(())
}

async fn demo(addr: SocketAddr, gets: u64, puts: u64) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["server", "--addr", &addr.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("server: {e}"))?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    // The server's actual address (with port 0, the one it got).
    let bound: SocketAddr = match lines.next() {
        Some(Ok(l)) if l.starts_with("listening on ") => {
            println!("{l}");
            l["listening on ".len()..]
                .parse()
                .map_err(|e| format!("server address in {l:?}: {e}"))?
        }
        other => return Err(format!("server did not come up: {other:?}")),
    };
    let rc = client(bound, gets, puts).await;
    for l in lines.map_while(Result::ok) {
        println!("{l}");
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    rc?;
    if !status.success() {
        return Err(format!("server: {status}"));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let r = match Cli::parse().cmd {
        Cmd::Server {
            addr,
            keys,
            value_len,
        } => server(addr, keys, value_len).await,
        Cmd::Client { addr, gets, puts } => client(addr, gets, puts).await,
        Cmd::Demo { addr, gets, puts } => demo(addr, gets, puts).await,
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("remote_kv: {e}");
            ExitCode::FAILURE
        }
    }
}
