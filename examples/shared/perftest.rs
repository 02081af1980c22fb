//! Running perftest (the raw-verbs reference) from the benchmarks: a server
//! and a client of one tool on this host, and the numbers of its result row.

use std::net::IpAddr;
use std::process::Stdio;
use std::time::Duration;

/// Runs a perftest server and client of `tool` with `args` on `port`
/// (client to `addr`); returns the client's stdout, or `None` when the tool
/// is missing or timed out.
pub async fn run(tool: &str, args: &[String], addr: IpAddr, port: u16) -> Option<String> {
    let mut base: Vec<String> = args.to_vec();
    base.extend(["-p".into(), port.to_string()]);
    let mut server = tokio::process::Command::new(tool)
        .args(&base)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut cargs = base.clone();
    cargs.push(addr.to_string());
    let out = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(tool).args(&cargs).output(),
    )
    .await
    .ok()?
    .ok()?;
    let _ = tokio::time::timeout(Duration::from_secs(5), server.wait()).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if row(&text).is_none() {
        eprintln!(
            "{tool} {} gave no result:\n{text}{}",
            cargs.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Some(text)
}

/// Runs only a perftest client of `tool` against a server that is already
/// listening on `addr:port` (another host); returns its stdout.
pub async fn client(tool: &str, args: &[String], addr: IpAddr, port: u16) -> Option<String> {
    let mut cargs: Vec<String> = args.to_vec();
    cargs.extend(["-p".into(), port.to_string(), addr.to_string()]);
    for _ in 0..5 {
        let out = tokio::time::timeout(
            Duration::from_secs(120),
            tokio::process::Command::new(tool).args(&cargs).output(),
        )
        .await
        .ok()?
        .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if row(&text).is_some() {
            return Some(text);
        }
        // The peer's server restarts between runs: try again shortly.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "{tool} {}: no result from the peer's server",
        cargs.join(" ")
    );
    None
}

/// The data row after perftest's `#bytes` header: its numeric columns.
pub fn row(out: &str) -> Option<Vec<f64>> {
    let mut lines = out.lines();
    lines
        .by_ref()
        .find(|l| l.trim_start().starts_with("#bytes"))?;
    let row = lines.find(|l| !l.trim().is_empty())?;
    let v: Vec<f64> = row
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    (!v.is_empty()).then_some(v)
}

/// The bandwidth of an `ib_write_bw`/`ib_send_bw` result (the client's
/// stdout) in 10^6 bytes/s: its "MB/sec" column (the 4th) is MiB/s (its
/// `--help`: "instead of MiB/sec"), converted.
pub fn bw_mb_per_s(out: &str) -> Option<f64> {
    row(out)?.get(3).map(|mib_per_s| mib_per_s * 1.048576)
}

/// The message rate of an `ib_send_bw` result (the client's stdout) in
/// messages/s: its "MsgRate[Mpps]" column (the 5th), converted.
#[allow(dead_code)] // used by echo_bench, not by perf
pub fn msg_rate(out: &str) -> Option<f64> {
    row(out)?.get(4).map(|mpps| mpps * 1e6)
}

/// `a / b` to two places, or `n/a` without a reference.
pub fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    }
}
