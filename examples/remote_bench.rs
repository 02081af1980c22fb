//! Remote-memory benchmark: one-sided RDMA READ, WRITE and fetch-and-add
//! through a `MessageEndpoint` against a grant of a server in another
//! process, next to perftest on the same device in the same run
//! (`ib_read_lat`, `ib_atomic_lat`, `ib_read_bw`, `ib_write_bw`), printed
//! as ratios, on both tokio runtime flavours.
//!
//! ```text
//! remote_bench --addr 10.11.0.1 [--device rxe0] [--gid-index 1] [--iters 2000] [--bytes 32MiB]
//! ```
//!
//! Latency: `--iters` sequential 8 B READs and fetch-and-adds (p50, mean,
//! p99 in microseconds; perftest's READ and atomic latencies are whole
//! round trips, like ours). Bandwidth: `--bytes` in 64 KiB operations with
//! 16 in flight (half the endpoint's remote slots), in 10^6 bytes/s, against
//! perftest's 64 KiB runs of the same count. Batched: the same bytes in
//! 4 KiB WRITEs posted 32 per doorbell (`MessageEndpoint::transfer`,
//! `MAX_TRANSFER_BATCH`) against `ib_write_bw -s 4096 -t 32 --post_list
//! 32` (32 in flight both). Each is measured twice: from and into pool buffers (`read`,
//! `write`: a WRITE's bytes are copied in first), and "in place", from and
//! into a region registered once (`read_to`, `write_from`,
//! `Transfer::WriteFrom`: zero-copy, as perftest). CPU: the client process's
//! CPU time per operation (10 ms ticks of /proc/self/stat); the server's
//! CPU time while serving is printed by the server.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use clap::Parser;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use tokio_rdma::remote::{GrantAccess, LocalRegion, MAX_TRANSFER_BATCH, RemoteRegion, Transfer};
use tokio_rdma::{MessageEndpoint, MessageListener};

#[path = "shared/cpu.rs"]
mod cpu;
#[path = "shared/pattern.rs"]
#[allow(dead_code)]
mod pattern;
#[path = "shared/perftest.rs"]
#[allow(dead_code)]
mod perftest;

/// Bytes of one bandwidth operation.
const OP: usize = 64 * 1024;
/// Operations in flight for bandwidth (16, as the figures since
/// 2026-12-06; the endpoint has 32 remote slots).
const IN_FLIGHT: usize = 16;
/// Bytes of one batched WRITE.
const SMALL: usize = 4096;

#[derive(Parser)]
#[command(about = "One-sided RDMA READ/WRITE/atomics vs perftest")]
struct Args {
    /// The RDMA device's IP address.
    #[arg(long)]
    addr: IpAddr,
    /// The device perftest runs on.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// perftest's GID index (`-x`).
    #[arg(long, default_value_t = 1)]
    gid_index: u32,
    /// Sequential operations per latency run.
    #[arg(long, default_value_t = 2000)]
    iters: u64,
    /// perftest's latency tools sleep on CQ events (`-e`) instead of
    /// busy polling: the reference for one vCPU (the deterministic setup),
    /// where a busy poller steals the CPU its peer and rxe need.
    #[arg(long)]
    events: bool,
    /// Bytes per bandwidth run.
    #[arg(long, default_value = "32MiB", value_parser = pattern::parse_size)]
    bytes: u64,
    /// Internal: run the granting server on this address.
    #[arg(long, hide = true)]
    serve: Option<SocketAddr>,
}

/// The granting side: one region of `IN_FLIGHT` x 64 KiB, READ, WRITE and
/// atomics, until the client closes.
async fn serve(addr: SocketAddr) -> Result<(), String> {
    let listener = MessageListener::bind(addr)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "listening on {}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    let (ep, _) = listener.accept().await.map_err(|e| e.to_string())?;
    let len = IN_FLIGHT * OP;
    let region = LocalRegion::new(ep.pool().alloc_any(len).await.map_err(|e| e.to_string())?);
    region
        .write_at(0, &pattern::pattern_vec(1, len))
        .map_err(|e| e.to_string())?;
    let access = GrantAccess::READ | GrantAccess::WRITE;
    // ATOMIC where the device executes atomics (not iWARP's siw:
    // `Error::NoAtomics`, `Unsupported`).
    let grant = match ep
        .grant(&region, 0..len, access | GrantAccess::ATOMIC)
        .await
    {
        Err(e) if e.kind() == std::io::ErrorKind::Unsupported => {
            ep.grant(&region, 0..len, access).await
        }
        r => r,
    }
    .map_err(|e| e.to_string())?;
    let cpu0 = cpu::cpu_us();
    let t0 = Instant::now();
    ep.send_copy(&grant.remote().encode())
        .await
        .map_err(|e| e.to_string())?;
    let _ = ep.recv().await;
    println!(
        "server: CPU {:.3} s while serving {:.1} s of one-sided operations",
        (cpu::cpu_us() - cpu0) as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

struct Lat {
    p50: f64,
    mean: f64,
    p99: f64,
    cpu_us: f64,
}

fn lat_of(h: &Histogram<u64>, cpu: u64, n: u64) -> Lat {
    Lat {
        p50: h.value_at_quantile(0.5) as f64 / 1e3,
        mean: h.mean() / 1e3,
        p99: h.value_at_quantile(0.99) as f64 / 1e3,
        cpu_us: cpu as f64 / n.max(1) as f64,
    }
}

struct Bw {
    mb_s: f64,
    cpu_us: f64,
}

struct Figures {
    read_lat: Lat,
    fadd_lat: Lat,
    /// The connection driver's wake-ups and the lock waits over the
    /// latency runs (`MessageStats::driver_wakeups`, `lock_waits`).
    lat_wakeups: (u64, u64),
    read_bw: Bw,
    write_bw: Bw,
    /// READs into a registered region in place (`read_to`).
    read_to_bw: Bw,
    /// WRITEs from a registered region in place (`write_from`).
    write_from_bw: Bw,
    batch_bw: Bw,
    /// The batch from a registered region (`Transfer::WriteFrom`).
    batch_from_bw: Bw,
}

async fn measure(
    ep: &MessageEndpoint,
    remote: &RemoteRegion,
    iters: u64,
    bytes: u64,
) -> Result<Figures, String> {
    let e = |e: std::io::Error| e.to_string();
    // Warm-up, of both operations timed below (the first call of a code
    // path may fault its pages in; under icount from the host's file
    // system when the binary is not staged).
    for _ in 0..100 {
        ep.read(remote, 0, 8).await.map_err(e)?;
        ep.fetch_add(remote, 0, 1).await.map_err(e)?;
    }
    let stats0 = ep.stats();
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    let cpu0 = cpu::cpu_us();
    for i in 0..iters {
        let t = Instant::now();
        ep.read(remote, (i % 512) * 8, 8).await.map_err(e)?;
        h.record(t.elapsed().as_nanos() as u64).ok();
    }
    let read_lat = lat_of(&h, cpu::cpu_us() - cpu0, iters);
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    let cpu0 = cpu::cpu_us();
    for _ in 0..iters {
        let t = Instant::now();
        ep.fetch_add(remote, 0, 1).await.map_err(e)?;
        h.record(t.elapsed().as_nanos() as u64).ok();
    }
    let fadd_lat = lat_of(&h, cpu::cpu_us() - cpu0, iters);
    let stats1 = ep.stats();
    let lat_wakeups = (
        stats1.driver_wakeups - stats0.driver_wakeups,
        stats1.lock_waits - stats0.lock_waits,
    );
    let ops = (bytes as usize).div_ceil(OP);
    let data = pattern::pattern_vec(2, OP);
    // The in-place runs' local memory: one 64 KiB slot per operation in
    // flight, registered once (zero-copy: no pool buffer, no copy).
    let local = ep
        .pool()
        .register_local(pattern::pattern_vec(2, IN_FLIGHT * OP))
        .map_err(|e| e.to_string())?;
    let mut bws = Vec::new();
    for (write, in_place) in [(false, false), (true, false), (false, true), (true, true)] {
        let cpu0 = cpu::cpu_us();
        let t0 = Instant::now();
        let mut inflight = FuturesUnordered::new();
        let mut next = 0usize;
        let mut done = 0usize;
        while done < ops {
            while next < ops && inflight.len() < IN_FLIGHT {
                let slot = (next % IN_FLIGHT) * OP;
                let off = slot as u64;
                let (data, local) = (&data, &local);
                inflight.push(async move {
                    match (write, in_place) {
                        (true, false) => ep.write(remote, off, data).await.map(|_| OP),
                        (false, false) => ep.read(remote, off, OP).await.map(|b| b.len()),
                        (true, true) => ep
                            .write_from(remote, off, local, slot, OP)
                            .await
                            .map(|_| OP),
                        (false, true) => ep.read_to(remote, off, local, slot, OP).await.map(|_| OP),
                    }
                });
                next += 1;
            }
            let n = inflight.next().await.expect("in flight").map_err(e)?;
            if n != OP {
                return Err(format!("operation moved {n} bytes"));
            }
            done += 1;
        }
        let secs = t0.elapsed().as_secs_f64();
        bws.push(Bw {
            mb_s: (ops * OP) as f64 / secs / 1e6,
            cpu_us: (cpu::cpu_us() - cpu0) as f64 / ops as f64,
        });
    }
    let mut bws = bws.into_iter();
    let mut next_bw = || bws.next().expect("four runs");
    let (read_bw, write_bw, read_to_bw, write_from_bw) =
        (next_bw(), next_bw(), next_bw(), next_bw());
    // 4 KiB WRITEs, MAX_TRANSFER_BATCH per doorbell, one batch at a time
    // (a batch takes every remote slot).
    let small = pattern::pattern_vec(3, SMALL);
    let batch: Vec<Transfer<'_>> = (0..MAX_TRANSFER_BATCH)
        .map(|k| Transfer::Write {
            remote,
            offset: (k * SMALL) as u64,
            data: &small,
        })
        .collect();
    let batch_from: Vec<Transfer<'_>> = (0..MAX_TRANSFER_BATCH)
        .map(|k| Transfer::WriteFrom {
            remote,
            offset: (k * SMALL) as u64,
            src: &local,
            at: k * SMALL,
            len: SMALL,
        })
        .collect();
    let batches = (bytes as usize).div_ceil(SMALL * MAX_TRANSFER_BATCH);
    let mut batch_bws = Vec::new();
    for ops_of_batch in [&batch, &batch_from] {
        let cpu0 = cpu::cpu_us();
        let t0 = Instant::now();
        for _ in 0..batches {
            ep.transfer(ops_of_batch).await.map_err(e)?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let ops = batches * MAX_TRANSFER_BATCH;
        batch_bws.push(Bw {
            mb_s: (ops * SMALL) as f64 / secs / 1e6,
            cpu_us: (cpu::cpu_us() - cpu0) as f64 / ops as f64,
        });
    }
    let batch_from_bw = batch_bws.pop().expect("two runs");
    let batch_bw = batch_bws.pop().expect("two runs");
    Ok(Figures {
        read_lat,
        fadd_lat,
        lat_wakeups,
        read_bw,
        write_bw,
        read_to_bw,
        write_from_bw,
        batch_bw,
        batch_from_bw,
    })
}

/// Starts the server in a child process and runs `measure` against it on
/// a runtime of `flavour`.
fn run_flavour(args: &Args, multi: bool) -> Result<Figures, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([
            "--addr",
            &args.addr.to_string(),
            "--serve",
            &format!("{}:0", args.addr),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let bound: SocketAddr = match lines.next() {
        Some(Ok(l)) if l.starts_with("listening on ") => l["listening on ".len()..]
            .parse()
            .map_err(|e| format!("{l:?}: {e}"))?,
        other => return Err(format!("server did not come up: {other:?}")),
    };
    let rt = if multi {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
    .map_err(|e| e.to_string())?;
    let figures = rt.block_on(async {
        let ep = MessageEndpoint::connect(bound)
            .await
            .map_err(|e| e.to_string())?;
        let hello = ep
            .recv()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no grant")?;
        let remote = RemoteRegion::decode(&hello).map_err(|e| e.to_string())?;
        // In a spawned task, as a service's handler runs (on the
        // multi-thread runtime `block_on`'s thread is not a worker: every
        // wake-up would be a hop to another thread).
        let (iters, bytes) = (args.iters, args.bytes);
        let (ep, f) = tokio::spawn(async move {
            let f = measure(&ep, &remote, iters, bytes).await;
            (ep, f)
        })
        .await
        .map_err(|e| e.to_string())?;
        ep.close().await.map_err(|e| e.to_string())?;
        f
    });
    for l in lines.map_while(Result::ok) {
        println!(
            "  ({}) {l}",
            if multi {
                "multi-thread"
            } else {
                "current_thread"
            }
        );
    }
    let _ = child.wait();
    figures
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(addr) = args.serve {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        return match rt.block_on(serve(addr)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("remote_bench server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut rows = Vec::new();
    for multi in [false, true] {
        match run_flavour(&args, multi) {
            Ok(f) => rows.push((multi, f)),
            Err(e) => {
                eprintln!("remote_bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    // perftest on the same device, same run.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let common = vec![
        "-d".to_string(),
        args.device.clone(),
        "-x".into(),
        args.gid_index.to_string(),
        "-F".into(),
    ];
    let with = |extra: &[&str]| {
        let mut v = common.clone();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let iters = args.iters.to_string();
    let ev: &[&str] = if args.events { &["-e"] } else { &[] };
    let ops = (args.bytes as usize).div_ceil(OP).to_string();
    let small_ops = ((args.bytes as usize).div_ceil(SMALL * MAX_TRANSFER_BATCH)
        * MAX_TRANSFER_BATCH)
        .to_string();
    let batch = MAX_TRANSFER_BATCH.to_string();
    let (read_lat, atomic_lat, read_bw, write_bw, batch_bw) = rt.block_on(async {
        let read_lat = perftest::run(
            "ib_read_lat",
            &with(&[&["-s", "8", "-n", &iters][..], ev].concat()),
            args.addr,
            18620,
        )
        .await
        .and_then(|o| perftest::row(&o));
        let atomic_lat = perftest::run(
            "ib_atomic_lat",
            &with(&[&["-n", &iters][..], ev].concat()),
            args.addr,
            18621,
        )
        .await
        .and_then(|o| perftest::row(&o));
        let read_bw = perftest::run(
            "ib_read_bw",
            &with(&["-s", "65536", "-n", &ops]),
            args.addr,
            18622,
        )
        .await
        .and_then(|o| perftest::bw_mb_per_s(&o));
        let write_bw = perftest::run(
            "ib_write_bw",
            &with(&["-s", "65536", "-n", &ops]),
            args.addr,
            18623,
        )
        .await
        .and_then(|o| perftest::bw_mb_per_s(&o));
        let batch_bw = perftest::run(
            "ib_write_bw",
            &with(&[
                "-s",
                "4096",
                "-t",
                &batch,
                "--post_list",
                &batch,
                "-n",
                &small_ops,
            ]),
            args.addr,
            18624,
        )
        .await
        .and_then(|o| perftest::bw_mb_per_s(&o));
        (read_lat, atomic_lat, read_bw, write_bw, batch_bw)
    });
    // Latency rows: #bytes #iter t_min t_max t_typical t_avg t_stdev 99% 99.9%.
    let col = |r: &Option<Vec<f64>>, i: usize| r.as_ref().and_then(|v| v.get(i).copied());
    println!("remote memory vs perftest (same device, same run; ratios: ours / perftest)");
    println!();
    println!(
        "latency, us            runtime          p50    mean     p99   CPU us/op   mean ratio"
    );
    let e = if args.events { " -e" } else { "" };
    for (name, r) in [
        (format!("ib_read_lat -s 8{e}"), &read_lat),
        (format!("ib_atomic_lat{e}"), &atomic_lat),
    ] {
        match (col(r, 4), col(r, 5), col(r, 7)) {
            (Some(p50), Some(mean), Some(p99)) => println!(
                "  {name:<20} {:<14} {p50:>7.1} {mean:>7.1} {p99:>7.1}          -       1.00",
                "(raw verbs)"
            ),
            _ => println!("  {name:<20} (perftest failed)"),
        }
    }
    for (multi, f) in &rows {
        let rt = if *multi {
            "multi-thread"
        } else {
            "current_thread"
        };
        for (name, l, reference) in [
            ("READ 8 B", &f.read_lat, col(&read_lat, 5)),
            ("fetch-and-add", &f.fadd_lat, col(&atomic_lat, 5)),
        ] {
            println!(
                "  {name:<20} {rt:<14} {:>7.1} {:>7.1} {:>7.1} {:>10.1} {:>10}",
                l.p50,
                l.mean,
                l.p99,
                l.cpu_us,
                perftest::ratio(l.mean, reference)
            );
        }
    }
    for (multi, f) in &rows {
        let rt = if *multi {
            "multi-thread"
        } else {
            "current_thread"
        };
        println!(
            "  ({rt}: {} driver wake-ups and {} lock waits in {} latency operations)",
            f.lat_wakeups.0,
            f.lat_wakeups.1,
            2 * args.iters
        );
    }
    println!();
    println!("bandwidth              runtime          MB/s   CPU us/op   ratio");
    let batch_ref = format!("ib_write_bw 4K pl{MAX_TRANSFER_BATCH}");
    let batch_ours = format!("WRITE 4 KiB x{MAX_TRANSFER_BATCH}");
    for (name, r) in [
        ("ib_read_bw 64 KiB", read_bw),
        ("ib_write_bw 64 KiB", write_bw),
        (batch_ref.as_str(), batch_bw),
    ] {
        match r {
            Some(b) => println!(
                "  {name:<20} {:<14} {b:>7.1}          -    1.00",
                "(raw verbs)"
            ),
            None => println!("  {name:<20} (perftest failed)"),
        }
    }
    for (multi, f) in &rows {
        let rt = if *multi {
            "multi-thread"
        } else {
            "current_thread"
        };
        for (name, b, reference) in [
            ("READ 64 KiB", &f.read_bw, read_bw),
            ("  in place", &f.read_to_bw, read_bw),
            ("WRITE 64 KiB", &f.write_bw, write_bw),
            ("  in place", &f.write_from_bw, write_bw),
            (batch_ours.as_str(), &f.batch_bw, batch_bw),
            ("  in place", &f.batch_from_bw, batch_bw),
        ] {
            println!(
                "  {name:<20} {rt:<14} {:>7.1} {:>10.1} {:>7}",
                b.mb_s,
                b.cpu_us,
                perftest::ratio(b.mb_s, reference)
            );
        }
    }
    ExitCode::SUCCESS
}
