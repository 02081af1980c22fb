//! Round-trip latency and one-way message rate of [`MessageEndpoint`].
//!
//! ```text
//! message_pingpong                                  # one process: echo server + client
//! message_pingpong --size 4096 --iters 2000
//! message_pingpong --stream --size 64 --count 20000 # one-way message rate
//! message_pingpong --server --addr 10.11.0.1:7700   # two processes: the echo server,
//! message_pingpong --client --addr 10.11.0.1:7700   # and the client
//! ```
//!
//! Ping-pong (the default): the client sends one `--size`-byte message at a
//! time from a pool buffer; the server sends the very [`PoolBytes`] it
//! received back (no copy). Each round trip is timed into an HDR
//! histogram; `--warmup` round trips are not counted. Every echoed message
//! is checked byte for byte against what was sent; a mismatch exits with
//! status 1. Prints p50/p90/p99/p99.9/max in microseconds and the rate.
//!
//! `--stream` (one process only): the client sends `--count` messages as
//! fast as credit allows (`send()` each, or with `--batch N` through the
//! `Sink`: N `feed`s, then `flush` posts them together) and flushes; the
//! receiver checks each one and the message rate is measured at the
//! receiver, from the first message to the last. Run it inside the Soft-RoCE guest (`integration/softroce run --
//! ...`) or on a host with an RDMA NIC; `integration/bench-message` runs it
//! against perftest.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::SinkExt;
use hdrhistogram::Histogram;
use tokio_rdma::message::MessageStats;
use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener, PoolBuf, PoolBytes};

#[path = "shared/pattern.rs"]
mod pattern;
use pattern::{fill_pattern, parse_size};

#[derive(Parser, Debug)]
#[command(about = "MessageEndpoint round-trip latency and message rate")]
struct Args {
    /// Address of the listener (an IP of an RDMA device).
    #[arg(long, default_value = "10.11.0.1:7700")]
    addr: SocketAddr,
    /// Message size, bytes (suffixes: KiB, MiB, GiB).
    #[arg(long, default_value = "64", value_parser = parse_size)]
    size: u64,
    /// Timed round trips.
    #[arg(long, default_value_t = 10_000)]
    iters: u64,
    /// Round trips before timing starts.
    #[arg(long, default_value_t = 1_000)]
    warmup: u64,
    /// One-way stream instead of ping-pong: rate measured at the receiver.
    #[arg(long, conflicts_with_all = ["server", "client"])]
    stream: bool,
    /// Messages sent by `--stream`.
    #[arg(long, default_value_t = 20_000)]
    count: u64,
    /// `--stream` sends through the `Sink` in batches of this many
    /// (`feed` each, then the Sink's `flush` posts them together); 1 calls
    /// `send()` for each message.
    #[arg(long, default_value_t = 1, requires = "stream")]
    batch: u64,
    /// Only the echo server (serves every connection until killed).
    #[arg(long, conflicts_with = "client")]
    server: bool,
    /// Only the client, connecting to `--addr`.
    #[arg(long)]
    client: bool,
    /// Receive buffers each endpoint keeps posted (its peer's eager
    /// credit; `RdmaConfig::recv_queue_depth`, default 128).
    #[arg(long)]
    recv_queue_depth: Option<u16>,
}

impl Args {
    /// The endpoints' config.
    fn config(&self) -> MessageConfig {
        let mut rdma = tokio_rdma::RdmaConfig::new();
        if let Some(d) = self.recv_queue_depth {
            rdma = rdma.recv_queue_depth(d);
        }
        MessageConfig::new().connection(rdma)
    }
}

/// Checks message `i` of `size` bytes against the pattern (`scratch` is
/// reused between calls).
fn check(msg: &[u8], i: u64, size: usize, scratch: &mut Vec<u8>) -> Result<(), String> {
    if msg.len() != size {
        return Err(format!(
            "message {i}: {} bytes came back, {size} were sent",
            msg.len()
        ));
    }
    scratch.resize(size, 0);
    fill_pattern(scratch, 0, i * size as u64);
    if let Some(k) = msg.iter().zip(scratch.iter()).position(|(a, b)| a != b) {
        return Err(format!(
            "message {i}: byte {k} is {:#04x}, expected {:#04x}",
            msg[k], scratch[k]
        ));
    }
    Ok(())
}

/// Message `i` (`size` bytes of the pattern) in a pool buffer.
async fn pattern_buf(ep: &MessageEndpoint, i: u64, size: usize) -> Result<PoolBuf, String> {
    let mut buf = ep
        .pool()
        .alloc_any(size)
        .await
        .map_err(|e| format!("pool: {e}"))?;
    fill_pattern(&mut buf.spare_mut()[..size], 0, i * size as u64);
    buf.set_len(size);
    Ok(buf)
}

/// Echoes every message back (the received buffer itself) until the peer
/// closes; returns how many.
async fn echo(ep: MessageEndpoint) -> std::io::Result<u64> {
    let mut n = 0;
    while let Some(msg) = ep.recv().await? {
        ep.send(msg).await?;
        n += 1;
    }
    ep.flush().await?;
    Ok(n)
}

/// The timed ping-pong; returns the RTT histogram (ns) and the wall time of
/// the timed part.
async fn pingpong(
    ep: &MessageEndpoint,
    size: usize,
    iters: u64,
    warmup: u64,
) -> Result<(Histogram<u64>, Duration), String> {
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    let mut scratch = Vec::new();
    let mut start = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            start = Instant::now();
        }
        let buf = pattern_buf(ep, i, size).await?;
        let t = Instant::now();
        ep.send(buf).await.map_err(|e| format!("send {i}: {e}"))?;
        let back: PoolBytes = ep
            .recv()
            .await
            .map_err(|e| format!("recv {i}: {e}"))?
            .ok_or_else(|| format!("the server closed after {i} round trips"))?;
        let rtt = t.elapsed();
        check(&back, i, size, &mut scratch)?;
        if i >= warmup {
            h.record(rtt.as_nanos() as u64).expect("record");
        }
    }
    Ok((h, start.elapsed()))
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

fn print_stats(side: &str, s: &MessageStats) {
    println!(
        "{side}: sent {} ({} eager, {} inline, {} rendezvous), received {}, \
         credits sent {}, credit stalls {}, send queue stalls {}, signaled {}/{} WRs",
        s.messages_sent,
        s.eager_sent,
        s.inline_sent,
        s.rendezvous_sent,
        s.messages_received,
        s.credits_sent,
        s.credit_stalls,
        s.send_queue_stalls,
        s.signaled,
        s.wrs_posted
    );
}

async fn run_client(ep: &MessageEndpoint, args: &Args) -> Result<(), String> {
    let size = args.size as usize;
    let (h, wall) = pingpong(ep, size, args.iters, args.warmup).await?;
    let secs = wall.as_secs_f64();
    println!(
        "message_pingpong: {} B, {} round trips ({} warm-up), device {}, every echo verified",
        size,
        args.iters,
        args.warmup,
        ep.device()
    );
    println!(
        "RTT us: p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.9)),
        us(h.value_at_quantile(0.99)),
        us(h.value_at_quantile(0.999)),
        us(h.max()),
        h.mean() / 1000.0
    );
    println!(
        "rate: {:.0} round trips/s, {:.0} messages/s (both directions), {:.2} MB/s each way",
        args.iters as f64 / secs,
        2.0 * args.iters as f64 / secs,
        (args.iters * args.size) as f64 / secs / 1e6
    );
    print_stats("client", &ep.stats());
    Ok(())
}

/// One process: echo server task + client.
async fn in_process(args: &Args) -> Result<(), String> {
    let cfg = args.config();
    let l = MessageListener::bind_with(args.addr, &cfg)
        .await
        .map_err(|e| format!("bind {}: {e}", args.addr))?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    let (c, s) = tokio::join!(MessageEndpoint::connect_with(addr, &cfg), l.accept());
    let client = c.map_err(|e| format!("connect {addr}: {e}"))?;
    let server = s.map_err(|e| format!("accept: {e}"))?.0;
    if args.stream {
        return stream(client, server, args).await;
    }
    let server_stats = server.clone();
    let echo_task = tokio::spawn(echo(server));
    run_client(&client, args).await?;
    drop(client);
    let echoed = echo_task
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("echo server: {e}"))?;
    print_stats("server", &server_stats.stats());
    if echoed != args.iters + args.warmup {
        return Err(format!(
            "the server echoed {echoed} messages, {} were sent",
            args.iters + args.warmup
        ));
    }
    Ok(())
}

/// One-way stream: `count` messages, rate measured at the receiver.
async fn stream(
    client: MessageEndpoint,
    server: MessageEndpoint,
    args: &Args,
) -> Result<(), String> {
    let size = args.size as usize;
    let count = args.count;
    let receiver = tokio::spawn(async move {
        let mut scratch = Vec::new();
        let mut first = None;
        let mut last = Instant::now();
        for i in 0..count {
            let msg = server
                .recv()
                .await
                .map_err(|e| format!("recv {i}: {e}"))?
                .ok_or_else(|| format!("the sender closed after {i} messages"))?;
            last = Instant::now();
            first.get_or_insert(last);
            check(&msg, i, size, &mut scratch)?;
        }
        let stats = server.stats();
        match server.recv().await {
            Ok(None) => Ok((first, last, stats)),
            Ok(Some(m)) => Err(format!("an extra message of {} bytes", m.len())),
            Err(e) => Err(format!("recv after the last message: {e}")),
        }
    });
    let start = Instant::now();
    if args.batch <= 1 {
        for i in 0..count {
            let buf = pattern_buf(&client, i, size).await?;
            client
                .send(buf)
                .await
                .map_err(|e| format!("send {i}: {e}"))?;
        }
    } else {
        // Sink: `feed` queues, the Sink's flush posts the batch at once.
        let mut sink = client.clone();
        let mut i = 0;
        while i < count {
            let end = (i + args.batch).min(count);
            for k in i..end {
                let buf = pattern_buf(&client, k, size).await?;
                sink.feed(buf).await.map_err(|e| format!("feed {k}: {e}"))?;
            }
            SinkExt::<PoolBuf>::flush(&mut sink)
                .await
                .map_err(|e| format!("posting messages {i}..{end}: {e}"))?;
            i = end;
        }
    }
    let queued = start.elapsed();
    client.flush().await.map_err(|e| format!("flush: {e}"))?;
    let flushed = start.elapsed();
    let client_stats = client.stats();
    let device = client.device().to_string();
    drop(client);
    let (first, last, server_stats) = receiver.await.map_err(|e| e.to_string())??;
    let span = first.map_or(Duration::ZERO, |f| last - f).as_secs_f64();
    let rate = if count > 1 && span > 0.0 {
        (count - 1) as f64 / span
    } else {
        0.0
    };
    let how = if args.batch <= 1 {
        "send() each".to_string()
    } else {
        format!("Sink feed + flush in batches of {}", args.batch)
    };
    println!(
        "message_pingpong --stream: {count} messages of {size} B ({how}), device {device}, every message verified"
    );
    println!(
        "receiver: {rate:.0} messages/s ({:.2} MB/s) from first to last message, {:.3} s",
        rate * size as f64 / 1e6,
        span
    );
    println!(
        "sender: all queued after {:.3} s, flushed after {:.3} s ({:.0} messages/s end to end)",
        queued.as_secs_f64(),
        flushed.as_secs_f64(),
        count as f64 / flushed.as_secs_f64()
    );
    print_stats("sender", &client_stats);
    print_stats("receiver", &server_stats);
    Ok(())
}

async fn serve(addr: SocketAddr, cfg: MessageConfig) -> Result<(), String> {
    let l = MessageListener::bind_with(addr, &cfg)
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    eprintln!(
        "message_pingpong: echo server on {}",
        l.local_addr().map_err(|e| e.to_string())?
    );
    loop {
        let (ep, peer) = l.accept().await.map_err(|e| format!("accept: {e}"))?;
        tokio::spawn(async move {
            match echo(ep).await {
                Ok(n) => eprintln!("message_pingpong: {peer}: echoed {n} messages"),
                Err(e) => eprintln!("message_pingpong: {peer}: {e}"),
            }
        });
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    let r = if args.server {
        serve(args.addr, args.config()).await
    } else if args.client {
        match MessageEndpoint::connect_with(args.addr, &args.config()).await {
            Ok(ep) => run_client(&ep, &args).await,
            Err(e) => Err(format!("connect {}: {e}", args.addr)),
        }
    } else {
        in_process(&args).await
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("message_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}
