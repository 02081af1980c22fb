//! Connections at scale, in one process on one device: setup rate
//! (sequential, and 32 concurrent connectors), registered memory and verbs
//! objects per connection at 1, 100, 1,000 and 4,000 held connections, and
//! the bulk throughput of one connection among 1,000 idle ones vs alone;
//! next to `rping` (rdma_cm connection setup, one process per connection)
//! in the same run. `integration/bench-conn` runs it in the guest.

use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;
use tokio_rdma::stats::resources;
use tokio_rdma::{RdmaConfig, RdmaListener, RdmaStream};

#[derive(Parser)]
#[command(about = "connection setup rate, memory per connection, bulk among idle connections")]
struct Args {
    /// IP address of the RDMA interface.
    #[arg(long, default_value = "10.11.0.1")]
    ip: IpAddr,
    /// Connections per setup-rate run.
    #[arg(long, default_value_t = 500)]
    connects: usize,
    /// Concurrent connectors in the second setup-rate run.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Bytes moved in each bulk run (64 KiB writes).
    #[arg(long, default_value_t = 64 << 20)]
    bulk_bytes: u64,
    /// rping client runs (one connection each).
    #[arg(long, default_value_t = 20)]
    rping_runs: usize,
}

fn cfg() -> RdmaConfig {
    RdmaConfig::new().connect_timeout(Duration::from_secs(240))
}

/// Accepts forever; every accepted stream is kept (held) until the task is
/// aborted, or dropped at once with `hold == false`.
fn accept_loop(l: RdmaListener, hold: bool) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            if hold {
                held.push(s);
            }
        }
    })
}

async fn listener(ip: IpAddr) -> (RdmaListener, SocketAddr) {
    let l = RdmaListener::bind_with(SocketAddr::new(ip, 0), &cfg())
        .await
        .expect("bind");
    let a = l.local_addr().unwrap();
    (l, a)
}

/// Connects/s with `concurrency` connectors making `n` connections in all.
async fn setup_rate(ip: IpAddr, n: usize, concurrency: usize) -> f64 {
    let (l, addr) = listener(ip).await;
    let server = accept_loop(l, false);
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for w in 0..concurrency {
        let share = n / concurrency + usize::from(w < n % concurrency);
        tasks.spawn(async move {
            for _ in 0..share {
                drop(
                    RdmaStream::connect_with(addr, &cfg())
                        .await
                        .expect("connect"),
                );
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let rate = n as f64 / start.elapsed().as_secs_f64();
    server.abort();
    rate
}

/// One stream moving `bytes` in 64 KiB writes; MB/s at the reader.
async fn bulk(ip: IpAddr, bytes: u64) -> f64 {
    let (l, addr) = listener(ip).await;
    let config = cfg();
    let (c, s) = tokio::join!(RdmaStream::connect_with(addr, &config), l.accept());
    let (mut c, (mut s, _)) = (c.expect("connect"), s.expect("accept"));
    let start = Instant::now();
    let writer = tokio::spawn(async move {
        let buf = vec![0x33u8; 64 * 1024];
        let mut sent = 0;
        while sent < bytes {
            c.write_all(&buf).await.expect("write");
            sent += buf.len() as u64;
        }
        c.shutdown().await.expect("shutdown");
    });
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0u64;
    loop {
        let n = s.read(&mut buf).await.expect("read");
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    writer.await.expect("writer");
    got as f64 / start.elapsed().as_secs_f64() / 1e6
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// `rping` client runs against one `rping` server: connections per second,
/// each run a process of its own (start-up and device open included).
async fn rping_rate(ip: IpAddr, runs: usize) -> Option<f64> {
    let port = "18530";
    let mut server = tokio::process::Command::new("rping")
        // -P: persistent server, one connection after another.
        .args(["-s", "-P", "-a", &ip.to_string(), "-p", port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start = Instant::now();
    for _ in 0..runs {
        let st = tokio::process::Command::new("rping")
            .args(["-c", "-a", &ip.to_string(), "-p", port, "-C", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .ok()?;
        if !st.success() {
            eprintln!("rping client failed: {st}");
            return None;
        }
    }
    let rate = runs as f64 / start.elapsed().as_secs_f64();
    let _ = server.kill().await;
    Some(rate)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = Args::parse();
    println!(
        "conn_bench: {} connects per setup run, {} concurrent, {} MiB bulk",
        a.connects,
        a.concurrency,
        a.bulk_bytes >> 20
    );
    let rping = rping_rate(a.ip, a.rping_runs).await;
    let seq = setup_rate(a.ip, a.connects, 1).await;
    let conc = setup_rate(a.ip, a.connects, a.concurrency).await;
    println!();
    println!("connection setup (connect + accept + close), connections/s");
    match rping {
        Some(r) => println!("  rping -c -C 1, a process per connection   {r:>9.1}"),
        None => println!("  rping                                       n/a"),
    }
    println!("  RdmaStream, sequential                    {seq:>9.1}");
    println!(
        "  RdmaStream, {} concurrent connectors      {conc:>9.1}",
        a.concurrency
    );

    // Alone first: right after thousands of connections close, their
    // teardown still runs in the background.
    let alone = bulk(a.ip, a.bulk_bytes).await;
    println!();
    println!("held connections (both ends in this process)   registered bytes per end   QPs   fds");
    let (l, addr) = listener(a.ip).await;
    let server = accept_loop(l, true);
    let base = resources();
    let mut held: Vec<RdmaStream> = Vec::new();
    let mut bulk_idle = None;
    for target in [1usize, 100, 1000, 4000] {
        while held.len() < target {
            let mut batch = JoinSet::new();
            for _ in 0..(target - held.len()).min(256) {
                batch.spawn(async move { RdmaStream::connect_with(addr, &cfg()).await });
            }
            while let Some(r) = batch.join_next().await {
                held.push(r.expect("task").expect("connect"));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = resources();
        let ends = 2 * target as u64;
        println!(
            "  {target:>5}                                      {:>10}   {:>5} {:>5}",
            (now.registered_bytes - base.registered_bytes) / ends,
            now.queue_pairs,
            open_fds()
        );
        if target == 1000 {
            bulk_idle = Some(bulk(a.ip, a.bulk_bytes).await);
        }
    }
    drop(held);
    server.abort();
    println!(
        "  (per end: ring and any send buffer held, plus the device's cache of idle send buffers spread over the ends)"
    );
    println!();
    println!("bulk, one connection, 64 KiB writes        MB/s   ratio");
    println!("  alone                               {alone:>10.2}    1.00");
    if let Some(b) = bulk_idle {
        println!(
            "  among 1,000 idle connections        {b:>10.2}    {:.2}",
            b / alone
        );
    }
}
