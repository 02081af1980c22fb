//! Side-by-side performance of RdmaStream, raw verbs (perftest) and TCP,
//! measured in one run on one device. Run it inside the Soft-RoCE guest with
//! `integration/bench`, or directly on a host with an RDMA NIC:
//!
//! ```text
//! perf --addr 10.11.0.1 --device rxe0 --gid-index 1
//! ```
//!
//! Measures
//! - bulk throughput with 64 KiB writes: RdmaStream vs `ib_write_bw -s 65536`
//!   vs TCP (tokio `TcpStream`) over the same interface;
//! - 64-byte ping-pong round trip: RdmaStream with busy polling, the default
//!   wait (adaptive spin, then park) and parked at once
//!   on the completion channel vs `ib_send_lat -s 64` (perftest reports half the
//!   round trip; it is doubled here) vs TCP.
//!
//! and prints ratios. Nothing here asserts a speed: this is a benchmark.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rdma::{RdmaConfig, RdmaListener, RdmaStream, WaitStrategy};

#[path = "shared/cpu.rs"]
mod cpu;
#[path = "shared/perftest.rs"]
#[allow(dead_code)]
mod perftest;
use perftest::ratio;

#[derive(Parser, Debug)]
#[command(about = "RdmaStream vs perftest vs TCP, side by side")]
struct Args {
    /// IP address of the RDMA interface (server and client run here).
    #[arg(long, default_value = "10.11.0.1")]
    addr: IpAddr,
    /// RDMA device for perftest.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// GID index for perftest (`-x`): the RoCE v2 GID of `addr`.
    #[arg(long, default_value_t = 1)]
    gid_index: u32,
    /// Bytes moved in each bulk throughput run.
    #[arg(long, default_value_t = 64 << 20)]
    bulk_bytes: u64,
    /// Round trips in each ping-pong run.
    #[arg(long, default_value_t = 2000)]
    iters: u64,
    /// Busy-poll budget in microseconds for the busy-poll latency run.
    #[arg(long, default_value_t = 200)]
    busy_poll_us: u64,
    /// Receive ring sizes (bytes, comma-separated) of the RdmaStream bulk
    /// runs: one row per combination with the other bulk lists, to see
    /// what the ring costs in throughput.
    #[arg(long, value_delimiter = ',', default_values_t = [65536u32])]
    ring_sizes: Vec<u32>,
    /// Send buffer sizes (bytes, comma-separated) of the bulk runs; one
    /// row per combination with the other bulk lists.
    #[arg(long, value_delimiter = ',', default_values_t = [65536u32])]
    send_buffer_sizes: Vec<u32>,
    /// Largest RDMA WRITE sizes (bytes, comma-separated) of the bulk runs.
    #[arg(long, value_delimiter = ',', default_values_t = [65536u32])]
    max_write_sizes: Vec<u32>,
    /// The bulk reader's buffer, bytes: every `read` asks for at most this
    /// much (hyper and tokio-util codecs start at 8 KiB). Writes stay
    /// 64 KiB.
    #[arg(long, default_value_t = CHUNK)]
    read_size: usize,
    /// Only the RdmaStream bulk rows, each combination once per round,
    /// for this many rounds (interleaved, for A/B comparisons); no
    /// perftest, TCP or latency runs.
    #[arg(long)]
    bulk_only: Option<u32>,
    /// Only the parked RdmaStream ping-pong (for profiling, e.g. under strace).
    #[arg(long)]
    pingpong_only: bool,
}

const CHUNK: usize = 64 * 1024;
const PING: usize = 64;

/// One core's memcpy rate for `CHUNK`-sized blocks, 10^6 bytes/s: what
/// each of the stream's two copies per byte (into the send buffer, out of
/// the receive ring) costs on this machine.
fn memcpy_mb_per_s() -> f64 {
    let src = vec![0x5Au8; CHUNK];
    let mut dst = vec![0u8; CHUNK];
    let rounds = 4096;
    let start = Instant::now();
    for _ in 0..rounds {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (rounds * CHUNK) as f64 / start.elapsed().as_secs_f64() / 1e6
}

/// Sends `bytes` in `CHUNK` writes while a task reads them `read_size`
/// bytes at a time and counts them; returns (10^6 bytes/s, CPUs busy:
/// process CPU time over wall time, both ends together).
async fn bulk<S, R>(mut tx: S, mut rx: R, bytes: u64, read_size: usize) -> (f64, f64)
where
    S: AsyncWrite + Unpin + Send + 'static,
    R: AsyncRead + Unpin + Send + 'static,
{
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; read_size.max(1)];
        let mut got = 0u64;
        while got < bytes {
            let n = rx.read(&mut buf).await.expect("bulk read");
            assert!(n > 0, "EOF after {got} bytes");
            got += n as u64;
        }
        Instant::now()
    });
    let buf = vec![0xA5u8; CHUNK];
    let cpu0 = cpu::cpu_us();
    let start = Instant::now();
    let mut sent = 0u64;
    while sent < bytes {
        let n = (bytes - sent).min(CHUNK as u64) as usize;
        tx.write_all(&buf[..n]).await.expect("bulk write");
        sent += n as u64;
    }
    let end = reader.await.expect("reader");
    let wall = (end - start).as_secs_f64();
    let cpu_s = (cpu::cpu_us() - cpu0) as f64 / 1e6;
    (bytes as f64 / wall / 1e6, cpu_s / wall)
}

/// 64-byte ping-pong; returns the RTT histogram in nanoseconds.
async fn pingpong<S, P>(mut client: S, mut server: P, iters: u64) -> Histogram<u64>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    P: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let echo = tokio::spawn(async move {
        let mut b = [0u8; PING];
        for _ in 0..iters {
            server.read_exact(&mut b).await.expect("pong read");
            server.write_all(&b).await.expect("pong write");
        }
    });
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    let mut b = [7u8; PING];
    for _ in 0..iters {
        let t = Instant::now();
        client.write_all(&b).await.expect("ping write");
        client.read_exact(&mut b).await.expect("ping read");
        h.record(t.elapsed().as_nanos() as u64).expect("record");
    }
    echo.await.expect("echo");
    h
}

async fn rdma_pair(addr: IpAddr, cfg: &RdmaConfig) -> (RdmaStream, RdmaStream) {
    let l = RdmaListener::bind_with(SocketAddr::new(addr, 0), cfg)
        .await
        .expect("bind");
    let a = l.local_addr().unwrap();
    let (c, s) = tokio::join!(RdmaStream::connect_with(a, cfg), l.accept());
    (c.expect("connect"), s.expect("accept").0)
}

async fn tcp_pair(addr: IpAddr) -> (TcpStream, TcpStream) {
    let l = TcpListener::bind(SocketAddr::new(addr, 0))
        .await
        .expect("tcp bind");
    let a = l.local_addr().unwrap();
    let (c, s) = tokio::join!(TcpStream::connect(a), l.accept());
    let c = c.expect("tcp connect");
    c.set_nodelay(true).unwrap();
    let s = s.expect("tcp accept").0;
    s.set_nodelay(true).unwrap();
    (c, s)
}

/// (ring, send buffer, WR size) in bytes, and what [`bulk`] returned.
type BulkRow = ((u32, u32, u32), (f64, f64));

/// One [`bulk`] run of RdmaStream per combination of `--ring-sizes`,
/// `--send-buffer-sizes` and `--max-write-sizes` on top of `cfg`.
async fn bulk_grid(args: &Args, cfg: &RdmaConfig) -> Vec<BulkRow> {
    let mut rows = Vec::new();
    for &ring in &args.ring_sizes {
        for &sb in &args.send_buffer_sizes {
            for &wr in &args.max_write_sizes {
                let bulk_cfg = cfg
                    .clone()
                    .ring_size(ring)
                    .send_buffer_size(sb)
                    .max_write_size(wr);
                let (c, s) = rdma_pair(args.addr, &bulk_cfg).await;
                rows.push((
                    (ring, sb, wr),
                    bulk(c, s, args.bulk_bytes, args.read_size).await,
                ));
            }
        }
    }
    rows
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let addr = args.addr;
    println!(
        "perf: device {} addr {addr}, {} MiB bulk, {} round trips",
        args.device,
        args.bulk_bytes >> 20,
        args.iters
    );

    let cfg = RdmaConfig::default();
    if args.pingpong_only {
        let (c, s) = rdma_pair(addr, &cfg).await;
        let h = pingpong(c, s, args.iters).await;
        println!(
            "RdmaStream parked 64 B RTT: p50 {:.1} us, p99 {:.1} us",
            us(h.value_at_quantile(0.5)),
            us(h.value_at_quantile(0.99))
        );
        return;
    }

    if let Some(rounds) = args.bulk_only {
        for round in 1..=rounds {
            for ((ring, sb, wr), (bw, cpus)) in bulk_grid(&args, &cfg).await {
                println!(
                    "round {round} ring/send buffer/WR {:>4}/{:>4}/{:>4} KiB {bw:>8.2} MB/s, CPUs busy {cpus:.2}",
                    ring >> 10,
                    sb >> 10,
                    wr >> 10
                );
            }
        }
        return;
    }

    // --- throughput ---------------------------------------------------
    let rdma_bw = bulk_grid(&args, &cfg).await;
    let (c, s) = tcp_pair(addr).await;
    let (tcp_bw, tcp_cpus) = bulk(c, s, args.bulk_bytes, args.read_size).await;
    let memcpy = memcpy_mb_per_s();
    let common = vec![
        "-d".to_string(),
        args.device.clone(),
        "-x".into(),
        args.gid_index.to_string(),
        "-F".into(),
    ];
    let mut bw_args = common.clone();
    bw_args.extend(["-s".into(), "65536".into(), "-D".into(), "5".into()]);
    let ib_bw = perftest::run("ib_write_bw", &bw_args, addr, 18515)
        .await
        .and_then(|o| perftest::bw_mb_per_s(&o));

    // --- latency -------------------------------------------------------
    let busy = RdmaConfig::default().busy_poll(Duration::from_micros(args.busy_poll_us));
    let (c, s) = rdma_pair(addr, &busy).await;
    let h_busy = pingpong(c, s, args.iters).await;
    let (c, s) = rdma_pair(addr, &cfg).await;
    let h_default = pingpong(c, s, args.iters).await;
    let park = RdmaConfig::default().wait_strategy(WaitStrategy::Park);
    let (c, s) = rdma_pair(addr, &park).await;
    let h_park = pingpong(c, s, args.iters).await;
    let (c, s) = tcp_pair(addr).await;
    let h_tcp = pingpong(c, s, args.iters).await;
    let mut lat_args = common;
    lat_args.extend([
        "-s".into(),
        "64".into(),
        "-n".into(),
        args.iters.to_string(),
    ]);
    // ib_send_lat prints one-way latency (half the round trip): double it.
    let ib_lat = perftest::run("ib_send_lat", &lat_args, addr, 18516)
        .await
        .and_then(|o| perftest::row(&o));
    let ib_rtt_typical = ib_lat.as_ref().and_then(|v| v.get(4)).map(|t| t * 2.0);
    let ib_rtt_p99 = ib_lat.as_ref().and_then(|v| v.get(7)).map(|t| t * 2.0);

    println!();
    println!(
        "throughput, 64 KiB writes            MB/s    vs ib_write_bw   CPUs busy   (RdmaStream: ring/send buffer/WR)"
    );
    match ib_bw {
        Some(b) => println!("  ib_write_bw (raw verbs)       {b:>10.2}    1.00"),
        None => println!("  ib_write_bw (raw verbs)              n/a    (perftest failed)"),
    }
    for &((ring, sb, wr), (bw, cpus)) in &rdma_bw {
        let label = format!(
            "RdmaStream, ring {}/{}/{} KiB",
            ring >> 10,
            sb >> 10,
            wr >> 10
        );
        println!(
            "  {label:<29} {bw:>10.2}    {:>11}   {cpus:>9.2}",
            ratio(bw, ib_bw)
        );
    }
    println!(
        "  TCP over the same interface   {tcp_bw:>10.2}    {:>11}   {tcp_cpus:>9.2}",
        ratio(tcp_bw, ib_bw)
    );
    // Each streamed byte is copied twice in user space (into the send
    // buffer, out of the receive ring): at the stream's own rate that takes
    // this share of one core.
    let stream_bw = rdma_bw.first().map(|&(_, (bw, _))| bw).unwrap_or(0.0);
    println!(
        "  memcpy, 64 KiB blocks, one core {memcpy:>8.0} MB/s: the stream's two copies per byte take {:.1} % of a core",
        200.0 * stream_bw / memcpy
    );
    println!();
    println!("64-byte round trip (us)          p50       p99     p50 vs ib_send_lat");
    match (ib_rtt_typical, ib_rtt_p99) {
        (Some(t), Some(p)) => println!("  ib_send_lat x2 (raw verbs) {t:>9.1} {p:>9.1}     1.00"),
        _ => println!("  ib_send_lat x2 (raw verbs)       n/a       n/a     (perftest failed)"),
    }
    for (name, h) in [
        ("RdmaStream busy-poll     ", &h_busy),
        ("RdmaStream default wait  ", &h_default),
        ("RdmaStream park at once  ", &h_park),
        ("TCP                      ", &h_tcp),
    ] {
        let p50 = us(h.value_at_quantile(0.5));
        let p99 = us(h.value_at_quantile(0.99));
        println!(
            "  {name}  {p50:>9.1} {p99:>9.1}     {}",
            ratio(p50, ib_rtt_typical)
        );
    }
}
