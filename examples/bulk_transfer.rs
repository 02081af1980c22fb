//! Bulk transfer over [`MessageEndpoint`], checked by CRC-32.
//!
//! ```text
//! bulk_transfer server 10.11.0.1:7800
//! bulk_transfer client 10.11.0.1:7800 --bytes 1GiB --message-size 1MiB
//! bulk_transfer client 10.11.0.1:7800 --file /path/to/file --message-size 256KiB
//! bulk_transfer loopback --bytes 256MiB --message-size 1MiB   # both in one process
//! ```
//!
//! The client sends `--bytes` of a deterministic pattern (generated
//! straight into pool buffers, no copy) or a file's bytes (read straight
//! into pool buffers), as messages of `--message-size` bytes (the last one
//! shorter), with up to `--window` messages (and 4 MiB, the default
//! `send_queue_bytes`) queued behind the peer's credit; then it flushes
//! (every message taken by the peer) and closes. The server accepts one
//! connection, receives until the client closes and prints the
//! message count, byte count and CRC-32 of everything received, in order.
//! Compare the two CRC lines; `loopback` does it itself and exits with
//! status 1 on a mismatch. `--no-check` sends the pool buffers as allocated
//! and skips the CRCs, to time the transport alone.
//!
//! Messages larger than `eager_buf_len` (4096) go by rendezvous (the
//! receiver RDMA READs them into its pool). A pool registers at most
//! 256 MiB by default, so for large messages both sides get a pool of their
//! own on the device serving their address, bounded by `--pool-bytes`
//! (default: room for two messages on the client, 528 MiB on the server,
//! which accepts messages up to that bound less 16 MiB).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, Parser, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::message::MessageStats;
use tokio_rdma::pool::{MemoryPool, PoolConfig};
use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener, verbs};

#[path = "shared/pattern.rs"]
mod pattern;
use pattern::{fill_pattern, parse_size};

const MIB: u64 = 1 << 20;
/// The default pool's bound on registered bytes (`PoolConfig::default`).
const DEFAULT_POOL_BYTES: u64 = 256 * MIB;
/// Headroom for receive buffers and other classes' slabs in a pool.
const POOL_HEADROOM: u64 = 16 * MIB;
/// `loopback` reports the counters after this long without progress.
const STALL_REPORT: Duration = Duration::from_secs(10);

#[derive(Parser)]
#[command(about = "Bulk transfer over MessageEndpoint with CRC-32 checks")]
struct Args {
    /// Log the transport's events at this level to stderr (error, warn,
    /// info, debug, trace).
    #[arg(long, global = true)]
    log: Option<tracing::Level>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Accept one connection, receive until it closes, print count and CRC.
    Server {
        /// Address to listen on (an IP of an RDMA device).
        addr: SocketAddr,
        /// Bound on the receive pool's registered bytes (suffixes: KiB, MiB,
        /// GiB); messages up to this less 16 MiB are accepted.
        #[arg(long, default_value = "528MiB", value_parser = parse_size)]
        pool_bytes: u64,
        /// RDMA device for the pool (default: the one serving `addr`).
        #[arg(long)]
        device: Option<String>,
        /// Bytes per RDMA READ of a rendezvous message
        /// (`MessageConfig::max_read_len`).
        #[arg(long, default_value = "64KiB", value_parser = parse_size)]
        max_read_len: u64,
        /// Rendezvous messages being read at once
        /// (`MessageConfig::max_rendezvous_in_flight`; both sides agree on
        /// the smaller).
        #[arg(long, default_value_t = 8)]
        rendezvous_in_flight: u16,
    },
    /// Send a pattern or a file to a server.
    Client {
        /// Server address.
        addr: SocketAddr,
        #[command(flatten)]
        send: SendArgs,
        /// Send this file's bytes instead of a pattern.
        #[arg(long, conflicts_with_all = ["bytes", "no_check"])]
        file: Option<PathBuf>,
    },
    /// Server and client in one process; checks that the CRCs match.
    Loopback {
        /// Address of the listener (an IP of an RDMA device).
        #[arg(long, default_value = "10.11.0.1:0")]
        addr: SocketAddr,
        #[command(flatten)]
        send: SendArgs,
    },
}

#[derive(ClapArgs, Clone)]
struct SendArgs {
    /// Bytes of pattern to send (suffixes: KiB, MiB, GiB).
    #[arg(long, value_parser = parse_size)]
    bytes: Option<u64>,
    /// Bytes per message; the last one may be shorter.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    message_size: u64,
    /// Messages queued behind the peer's credit before sending waits
    /// (`MessageConfig::send_queue_limit`; the bound in bytes,
    /// `MessageConfig::send_queue_bytes`, 4 MiB by default, applies as
    /// well).
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Bound on the sender's pool (default: room for two messages, at least
    /// 256 MiB).
    #[arg(long, value_parser = parse_size)]
    pool_bytes: Option<u64>,
    /// RDMA device for the sender's pool (default: the one serving the
    /// local address towards the server).
    #[arg(long)]
    device: Option<String>,
    /// Send pool buffers as allocated: no pattern and no CRC on either side
    /// of `loopback` (measures the transport alone; counts are still
    /// compared).
    #[arg(long)]
    no_check: bool,
}

/// The RDMA device whose GID table has `ip`.
fn device_for(ip: IpAddr) -> Option<String> {
    let devices = verbs::devices().ok()?;
    verbs::device::select_from(&devices, ip)
        .ok()
        .map(|a| a.device)
}

/// The local address the kernel routes to `peer` from (connecting a UDP
/// socket sends nothing).
fn local_ip_towards(peer: SocketAddr) -> Option<IpAddr> {
    let any = if peer.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let s = std::net::UdpSocket::bind(any).ok()?;
    s.connect(peer).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

/// A config whose pool registers up to `pool_bytes` (the shared default
/// pool when that is no more than its bound).
fn config_with_pool(
    pool_bytes: u64,
    device: Option<String>,
    local_ip: Option<IpAddr>,
) -> Result<MessageConfig, String> {
    let cfg = MessageConfig::new();
    if pool_bytes <= DEFAULT_POOL_BYTES {
        return Ok(cfg);
    }
    let device = device
        .or_else(|| local_ip.and_then(device_for))
        .ok_or_else(|| {
            "cannot tell which RDMA device serves this address; pass --device".to_string()
        })?;
    let pool = MemoryPool::for_device(&device, PoolConfig::new().max_registered_bytes(pool_bytes))
        .map_err(|e| format!("pool on {device}: {e}"))?;
    Ok(cfg.pool(pool))
}

/// The receiving side's config.
fn server_config(
    addr: SocketAddr,
    pool_bytes: u64,
    device: Option<String>,
) -> Result<MessageConfig, String> {
    let max = pool_bytes.saturating_sub(POOL_HEADROOM).max(MIB);
    let ip = (!addr.ip().is_unspecified()).then_some(addr.ip());
    Ok(config_with_pool(pool_bytes, device, ip)?.max_message_len(max))
}

/// The sending side's config.
fn client_config(addr: SocketAddr, send: &SendArgs) -> Result<MessageConfig, String> {
    let m = send.message_size.div_ceil(4096) * 4096;
    let pool_bytes = send
        .pool_bytes
        .unwrap_or_else(|| DEFAULT_POOL_BYTES.max(2 * m + POOL_HEADROOM));
    let local = local_ip_towards(addr);
    Ok(config_with_pool(pool_bytes, send.device.clone(), local)?
        .max_message_len(send.message_size.max(1 << 30))
        .send_queue_limit(send.window.max(1)))
}

/// What one side saw.
struct Tally {
    messages: u64,
    bytes: u64,
    /// CRC-32 of every byte, in order (`None` with `--no-check`).
    crc: Option<u32>,
    /// Receiver: when the last message arrived.
    last: Instant,
    stats: MessageStats,
}

/// Receives until the peer closes (CRC over every byte unless `!check`).
/// On an error, says what arrived before.
async fn receive(ep: MessageEndpoint, check: bool) -> Result<Tally, String> {
    let mut h = crc32fast::Hasher::new();
    let (mut messages, mut bytes) = (0u64, 0u64);
    let mut last = Instant::now();
    loop {
        match ep.recv().await {
            Ok(Some(msg)) => {
                last = Instant::now();
                if check {
                    h.update(&msg);
                }
                messages += 1;
                bytes += msg.len() as u64;
            }
            Ok(None) => break,
            Err(e) => {
                return Err(format!(
                    "receive failed after {messages} messages, {bytes} bytes: {e}"
                ));
            }
        }
    }
    Ok(Tally {
        messages,
        bytes,
        crc: check.then(|| h.finalize()),
        last,
        stats: ep.stats(),
    })
}

/// Where the client's bytes come from.
enum Source {
    Pattern(u64),
    /// `--no-check`: whatever the pool buffer holds.
    AsAllocated(u64),
    File(tokio::fs::File, u64),
}

impl Source {
    async fn open(send: &SendArgs, file: Option<&PathBuf>) -> Result<Source, String> {
        match (file, send.bytes) {
            (Some(p), _) => {
                let f = tokio::fs::File::open(p)
                    .await
                    .map_err(|e| format!("{}: {e}", p.display()))?;
                let len = f
                    .metadata()
                    .await
                    .map_err(|e| format!("{}: {e}", p.display()))?
                    .len();
                Ok(Source::File(f, len))
            }
            (None, Some(n)) if send.no_check => Ok(Source::AsAllocated(n)),
            (None, Some(n)) => Ok(Source::Pattern(n)),
            (None, None) => Err("give --bytes or --file".into()),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Source::Pattern(n) | Source::AsAllocated(n) | Source::File(_, n) => *n,
        }
    }

    /// Fills `buf` with the bytes at offset `off`.
    async fn fill(&mut self, buf: &mut [u8], off: u64) -> io::Result<()> {
        match self {
            Source::Pattern(_) => {
                fill_pattern(buf, 0, off);
                Ok(())
            }
            Source::AsAllocated(_) => Ok(()),
            Source::File(f, _) => f.read_exact(buf).await.map(|_| ()),
        }
    }
}

/// Sends every byte of `src` in messages of `message_size`, then flushes.
async fn send_all(
    ep: &MessageEndpoint,
    src: &mut Source,
    message_size: u64,
) -> Result<Tally, String> {
    let total = src.len();
    let mut h = crc32fast::Hasher::new();
    let (mut off, mut messages) = (0u64, 0u64);
    while off < total {
        let n = (total - off).min(message_size.max(1)) as usize;
        let mut buf = ep
            .pool()
            .alloc_any(n)
            .await
            .map_err(|e| format!("pool buffer of {n} bytes: {e}"))?;
        src.fill(&mut buf.spare_mut()[..n], off)
            .await
            .map_err(|e| format!("reading the file at {off}: {e}"))?;
        buf.set_len(n);
        if !matches!(src, Source::AsAllocated(_)) {
            h.update(buf.as_slice());
        }
        ep.send(buf)
            .await
            .map_err(|e| format!("send of message {messages} (offset {off}): {e}"))?;
        off += n as u64;
        messages += 1;
    }
    ep.flush().await.map_err(|e| format!("flush: {e}"))?;
    Ok(Tally {
        messages,
        bytes: off,
        crc: (!matches!(src, Source::AsAllocated(_))).then(|| h.finalize()),
        last: Instant::now(),
        stats: ep.stats(),
    })
}

fn crc_text(crc: Option<u32>) -> String {
    match crc {
        Some(c) => format!("crc32 {c:#010x}"),
        None => "crc32 not computed (--no-check)".into(),
    }
}

fn rate(t: &Tally, secs: f64) -> String {
    format!(
        "{:.2} MB/s, {:.1} msgs/s",
        t.bytes as f64 / secs / 1e6,
        t.messages as f64 / secs
    )
}

fn stats_line(side: &str, s: &MessageStats) -> String {
    format!(
        "{side}: sent {} eager + {} rendezvous, received {} eager + {} rendezvous, \
         {} READ WRs ({} bytes), {}/{} WRs signaled, stalls: credit {}, rendezvous {}, \
         send queue {}",
        s.eager_sent,
        s.rendezvous_sent,
        s.eager_received,
        s.rendezvous_received,
        s.read_wrs,
        s.read_bytes,
        s.signaled,
        s.wrs_posted,
        s.credit_stalls,
        s.rendezvous_stalls,
        s.send_queue_stalls
    )
}

async fn server(
    addr: SocketAddr,
    pool_bytes: u64,
    device: Option<String>,
    max_read_len: u32,
    rendezvous_in_flight: u16,
) -> Result<(), String> {
    let cfg = server_config(addr, pool_bytes, device)?
        .max_read_len(max_read_len)
        .max_rendezvous_in_flight(rendezvous_in_flight);
    let l = MessageListener::bind_with(addr, &cfg)
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    eprintln!(
        "bulk_transfer: listening on {}",
        l.local_addr().map_err(|e| e.to_string())?
    );
    let (ep, peer) = l.accept().await.map_err(|e| format!("accept: {e}"))?;
    let start = Instant::now();
    eprintln!("bulk_transfer: {peer} connected on {}", ep.device());
    let watch = tokio::spawn(stall_reporter(Arc::new(Mutex::new(None)), Some(ep.clone())));
    let t = receive(ep, true).await;
    watch.abort();
    let t = t?;
    let secs = (t.last - start).as_secs_f64().max(1e-9);
    println!(
        "received {} messages, {} bytes, {}",
        t.messages,
        t.bytes,
        crc_text(t.crc)
    );
    println!("{:.3} s, {}", secs, rate(&t, secs));
    eprintln!("{}", stats_line("server", &t.stats));
    Ok(())
}

async fn client(addr: SocketAddr, send: SendArgs, file: Option<PathBuf>) -> Result<(), String> {
    let mut src = Source::open(&send, file.as_ref()).await?;
    let cfg = client_config(addr, &send)?;
    let ep = MessageEndpoint::connect_with(addr, &cfg)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let mut out = tokio::io::stdout();
    let _ = out.write_all(b"connected\n").await;
    let _ = out.flush().await;
    let start = Instant::now();
    let sender_watch = Arc::new(Mutex::new(Some(ep.clone())));
    let watch = tokio::spawn(stall_reporter(Arc::clone(&sender_watch), None));
    let t = send_all(&ep, &mut src, send.message_size).await;
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    // The reporter's clone must go too, or close waits for it.
    sender_watch.lock().unwrap().take();
    watch.abort();
    let t = t?;
    // Every message was taken; disconnect before the runtime shuts down.
    ep.close().await.map_err(|e| format!("close: {e}"))?;
    println!(
        "sent {} messages, {} bytes, {}",
        t.messages,
        t.bytes,
        crc_text(t.crc)
    );
    println!("{:.3} s, {}", secs, rate(&t, secs));
    eprintln!("{}", stats_line("client", &t.stats));
    Ok(())
}

/// Prints both endpoints' counters and the pools' to stderr whenever
/// nothing moved for [`STALL_REPORT`] (a stuck transfer says where it is).
/// Holds the sender only through `sender`, which the caller empties before
/// closing.
async fn stall_reporter(
    sender: Arc<Mutex<Option<MessageEndpoint>>>,
    receiver: Option<MessageEndpoint>,
) {
    let mut last = None;
    let start = Instant::now();
    loop {
        tokio::time::sleep(STALL_REPORT).await;
        let snd = sender
            .lock()
            .unwrap()
            .as_ref()
            .map(|e| (e.stats(), e.pool().stats()));
        let rcv = receiver.as_ref().map(|r| (r.stats(), r.pool().stats()));
        let progress = (
            snd.as_ref()
                .map(|(s, _)| (s.messages_sent, s.control_received, s.wrs_posted)),
            rcv.as_ref()
                .map(|(r, _)| (r.read_bytes, r.messages_received, r.wrs_posted)),
        );
        if last.as_ref() == Some(&progress) {
            eprintln!(
                "bulk_transfer: no progress for {} s (at {:.0} s)",
                STALL_REPORT.as_secs(),
                start.elapsed().as_secs_f64()
            );
            match &snd {
                Some((s, p)) => eprintln!("  sender {s:?}\n  sender pool {p:?}"),
                None if receiver.is_none() => eprintln!("  sender closed"),
                None => {}
            }
            if let Some((r, p)) = &rcv {
                eprintln!("  receiver {r:?}\n  receiver pool {p:?}");
            }
        }
        last = Some(progress);
    }
}

async fn loopback(addr: SocketAddr, send: SendArgs) -> Result<(), String> {
    let mut src = Source::open(&send, None).await?;
    // The receiving pool holds two messages, like the sender's.
    let two = 2 * send.message_size.div_ceil(4096) * 4096 + POOL_HEADROOM;
    let scfg = server_config(addr, DEFAULT_POOL_BYTES.max(two), None)?;
    let ccfg = client_config(addr, &send)?;
    let l = MessageListener::bind_with(addr, &scfg)
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    let laddr = l.local_addr().map_err(|e| e.to_string())?;
    let (c, s) = tokio::join!(MessageEndpoint::connect_with(laddr, &ccfg), l.accept());
    let ep = c.map_err(|e| format!("connect {laddr}: {e}"))?;
    let sep = s.map_err(|e| format!("accept: {e}"))?.0;
    let device = ep.device().to_string();
    let sender_watch = Arc::new(Mutex::new(Some(ep.clone())));
    let watch = tokio::spawn(stall_reporter(Arc::clone(&sender_watch), Some(sep.clone())));
    let receiver = tokio::spawn(receive(sep, !send.no_check));
    let start = Instant::now();
    let sent = send_all(&ep, &mut src, send.message_size).await;
    let send_secs = start.elapsed().as_secs_f64().max(1e-9);
    // The reporter's clone must go too, or the connection never closes.
    sender_watch.lock().unwrap().take();
    drop(ep);
    let sent = sent?;
    let got = receiver.await.map_err(|e| e.to_string())?;
    watch.abort();
    let got = got?;
    let secs = (got.last - start).as_secs_f64().max(1e-9);
    println!(
        "bulk_transfer loopback on {device}: {} bytes in messages of {} bytes",
        sent.bytes, send.message_size
    );
    println!(
        "sent     {} messages, {} bytes, {}, flushed after {:.3} s",
        sent.messages,
        sent.bytes,
        crc_text(sent.crc),
        send_secs
    );
    println!(
        "received {} messages, {} bytes, {}, last after {:.3} s",
        got.messages,
        got.bytes,
        crc_text(got.crc),
        secs
    );
    println!("throughput at the receiver: {}", rate(&got, secs));
    println!("{}", stats_line("sender", &sent.stats));
    println!("{}", stats_line("receiver", &got.stats));
    if (got.messages, got.bytes, got.crc) != (sent.messages, sent.bytes, sent.crc) {
        return Err("MISMATCH: the receiver did not get what was sent".into());
    }
    println!(
        "{}",
        if send.no_check {
            "counts match (--no-check: contents not checked)"
        } else {
            "crc32 match"
        }
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(level) = args.log {
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .init();
    }
    let r = match args.cmd {
        Cmd::Server {
            addr,
            pool_bytes,
            device,
            max_read_len,
            rendezvous_in_flight,
        } => {
            let reads = u32::try_from(max_read_len).map_err(|_| "--max-read-len too large".into());
            match reads {
                Ok(r) => server(addr, pool_bytes, device, r, rendezvous_in_flight).await,
                Err(e) => Err(e),
            }
        }
        Cmd::Client { addr, send, file } => client(addr, send, file).await,
        Cmd::Loopback { addr, send } => {
            if send.bytes.is_none() {
                Err("loopback needs --bytes".into())
            } else {
                loopback(addr, send).await
            }
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bulk_transfer: {e}");
            ExitCode::FAILURE
        }
    }
}
