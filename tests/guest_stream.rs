//! Guest tests for RdmaStream/RdmaListener (run inside the Soft-RoCE guest
//! by `scripts/test`; they fail, never skip, without rxe0).
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it), so
//! host builds (`cargo test --all-features` included) leave it empty.
#![cfg(tokio_rdma_guest)]

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::error::RejectReason;
use tokio_rdma::{Error, RdmaConfig, RdmaListener, RdmaStream, WaitStrategy};

mod common;
use common::{echo, example, signal};

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

const IP: &str = "10.11.0.1";

/// A splitmix64 hash of (seed, i / 8), so the pattern has no period shorter
/// than 2^64 bytes: bytes from a stale lap of a ring never match.
fn pattern(seed: u64, i: u64) -> u8 {
    shared::pattern_byte(seed, i)
}

async fn bind(cfg: &RdmaConfig) -> RdmaListener {
    RdmaListener::bind_with(format!("{IP}:0"), cfg)
        .await
        .expect("bind on rxe0's address")
}

/// `select_device` names the guest's device for its address on either
/// provider: by the GID that carries it on Soft-RoCE, through rdma_cm's
/// bind on Soft-iWARP (whose GIDs carry the MAC address); an address no
/// device has is `NoDeviceForAddress`.
#[test]
fn select_device_names_the_guest_device_for_its_address() {
    use tokio_rdma::verbs;
    let ip: std::net::IpAddr = IP.parse().unwrap();
    let sel = verbs::select_device(ip).expect("a device for the guest address");
    assert_eq!(sel.device, common::device());
    assert_eq!(sel.port_num, 1);
    let sysfs = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{}/ports/1/gids/{}",
        sel.device, sel.gid_index
    ))
    .expect("sysfs gid entry");
    assert_eq!(sysfs.trim().parse::<std::net::Ipv6Addr>().unwrap(), sel.gid);
    if common::iwarp() {
        assert_eq!(sel.gid_index, 0);
    } else {
        assert_eq!(sel.gid, ip_v4_mapped(IP));
    }
    let other: std::net::IpAddr = "10.11.0.77".parse().unwrap();
    match verbs::select_device(other) {
        Err(Error::NoDeviceForAddress { addr }) => assert_eq!(addr, other),
        r => panic!("expected NoDeviceForAddress, got {r:?}"),
    }
}

fn ip_v4_mapped(ip: &str) -> std::net::Ipv6Addr {
    ip.parse::<std::net::Ipv4Addr>().unwrap().to_ipv6_mapped()
}

/// Accepts `n` connections on `l` and echoes each on a task of its own
/// until EOF; resolves to the bytes echoed on all of them.
fn echo_accepted(l: RdmaListener, n: usize) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (s, _) = l.accept().await.unwrap();
            tasks.push(tokio::spawn(echo(s)));
        }
        let mut sum = 0;
        for t in tasks {
            sum += t.await.unwrap().unwrap();
        }
        sum
    })
}

/// Writes `len` pattern bytes and half-closes while reading the echo;
/// checks every byte and the final EOF. Returns bytes echoed.
async fn echo_roundtrip(s: RdmaStream, seed: u64, len: u64, chunk: usize) -> io::Result<u64> {
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; chunk];
        let mut sent = 0u64;
        while sent < len {
            let n = (len - sent).min(chunk as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(seed, sent + k as u64);
            }
            wr.write_all(&buf[..n]).await?;
            sent += n as u64;
        }
        wr.shutdown().await?;
        Ok::<_, io::Error>(wr)
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    loop {
        let n = rd.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        for (k, &b) in buf[..n].iter().enumerate() {
            let i = got + k as u64;
            assert_eq!(b, pattern(seed, i), "byte {i} of {len} differs");
        }
        got += n as u64;
    }
    let wr = writer.await.expect("writer task")?;
    let s = rd.reunite(wr).expect("halves of one stream");
    drop(s);
    Ok(got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_sizes_across_ring_wrap() {
    // Odd ring and send-buffer sizes make every transfer wrap both.
    let cfg = RdmaConfig::new().ring_size(8191).send_buffer_size(5003);
    let l = bind(&cfg).await;
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut totals = Vec::new();
        for _ in 0..5 {
            let (s, _) = l.accept().await.unwrap();
            totals.push(echo(s).await.unwrap());
        }
        totals
    });
    let sizes = [0u64, 1, 4095, 4097, 1 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        let s = RdmaStream::connect_with(addr, &cfg).await.unwrap();
        assert_eq!(s.peer_addr().unwrap(), addr);
        assert_eq!(s.device(), common::device());
        let got = echo_roundtrip(s, i as u64, len, 3001).await.unwrap();
        assert_eq!(got, len);
    }
    assert_eq!(server.await.unwrap(), sizes.to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_256_mib() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        echo(s).await.unwrap()
    });
    let s = RdmaStream::connect(addr).await.unwrap();
    let len = 256u64 << 20;
    assert_eq!(echo_roundtrip(s, 7, len, 64 * 1024).await.unwrap(), len);
    assert_eq!(server.await.unwrap(), len);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_connections_both_ways() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let server = echo_accepted(l, 100);
    let clients: Vec<_> = (0..100u64)
        .map(|c| {
            tokio::spawn(async move {
                let cfg = RdmaConfig::new().connect_timeout(Duration::from_secs(120));
                let s = RdmaStream::connect_with(addr, &cfg).await.unwrap();
                echo_roundtrip(s, c, 1 << 20, 16 * 1024).await.unwrap()
            })
        })
        .collect();
    for c in clients {
        assert_eq!(c.await.unwrap(), 1 << 20);
    }
    assert_eq!(server.await.unwrap(), 100 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_both_ways() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let reply: Vec<u8> = (0..100_000u64).map(|i| pattern(3, i)).collect();
    let reply2 = reply.clone();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut req = Vec::new();
        s.read_to_end(&mut req).await.unwrap(); // EOF after the client's shutdown
        s.write_all(&reply2).await.unwrap(); // still allowed after reading EOF
        s.shutdown().await.unwrap();
        let mut tail = [0u8; 1];
        assert_eq!(s.read(&mut tail).await.unwrap(), 0, "EOF stays EOF");
        req
    });
    let mut c = RdmaStream::connect(addr).await.unwrap();
    c.write_all(b"request body").await.unwrap();
    c.shutdown().await.unwrap();
    let err = c.write(b"x").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    let mut got = Vec::new();
    c.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, reply);
    assert_eq!(c.read(&mut [0u8; 8]).await.unwrap(), 0);
    assert_eq!(server.await.unwrap(), b"request body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_blocks_instead_of_returning_zero() {
    // The server neither reads nor drains its ring (recv_buffer_limit 0), so
    // the client can buffer exactly its send buffer plus the server's ring.
    let server_cfg = RdmaConfig::new().ring_size(8191).recv_buffer_limit(0);
    let client_cfg = RdmaConfig::new().send_buffer_size(5003);
    let l = bind(&server_cfg).await;
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        rx.await.unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        all
    });
    let mut c = RdmaStream::connect_with(addr, &client_cfg).await.unwrap();
    let mut accepted = 0usize;
    let mut written = Vec::new();
    loop {
        let chunk: Vec<u8> = (0..1000u64)
            .map(|i| pattern(9, accepted as u64 + i))
            .collect();
        match tokio::time::timeout(Duration::from_secs(3), c.write(&chunk)).await {
            Ok(Ok(n)) => {
                assert!(n > 0, "poll_write returned Ok(0) for a non-empty buffer");
                written.extend_from_slice(&chunk[..n]);
                accepted += n;
            }
            Ok(Err(e)) => panic!("write failed: {e}"),
            Err(_) => break, // Pending: the peer's ring and our send buffer are full
        }
    }
    assert_eq!(accepted, 8191 + 5003);
    assert!(c.stats().credit_stalls >= 1);
    // The peer's ring is longer than the send buffer from the handshake on,
    // but it never grew: the send buffer stays as configured.
    assert_eq!(c.stats().send_buffer_size, 5003);
    tx.send(()).unwrap();
    c.shutdown().await.unwrap();
    assert_eq!(server.await.unwrap(), written);
}

/// A reader that takes a little of what arrived straight from the ring
/// and then stops reading (h2 does while its own writes are blocked) still
/// lets the writer finish: the bytes it left in the ring are moved out by
/// the driver after a tick without reads, which returns their credit, and
/// the writer's 8 rings' worth goes out while the reader sleeps, even
/// while the sleeping side writes 4 times as much the other way (whose
/// CREDITs wake its driver more often than its tick). Then every byte
/// arrives once, in order, and what the driver moved is counted. Whether
/// a read took bytes straight from the ring depends on who polls the CQ
/// first, the reader or the driver: a connection on which the driver did
/// is tried again, up to 10 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_a_reader_leaves_in_the_ring_are_moved_out_while_it_sleeps() {
    const RING: usize = 16 * 1024;
    const LEN: usize = 8 * RING;
    const SMALL: usize = 100;
    let l = bind(&RdmaConfig::new().ring_size(RING as u32)).await;
    let addr = l.local_addr().unwrap();
    let data: Vec<u8> = (0..LEN as u64).map(|i| pattern(21, i)).collect();
    let reply: Vec<u8> = (0..4 * LEN as u64).map(|i| pattern(22, i)).collect();
    let client_cfg = RdmaConfig::new().send_buffer_size(RING as u32);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut c = RdmaStream::connect_with(addr, &client_cfg).await.unwrap();
        let (mut s, _) = l.accept().await.unwrap();
        // One byte first, so the server's driver leaves completion events
        // to its parked reader.
        c.write_all(&[7]).await.unwrap();
        let mut one = [0u8; 1];
        s.read_exact(&mut one).await.unwrap();
        assert_eq!(one, [7]);
        // A parked read of SMALL bytes, then one ring's worth arrives.
        let buffered_before = s.stats().bytes_buffered;
        let mut small = [0u8; SMALL];
        let (n, ()) = tokio::join!(s.read(&mut small), async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            c.write_all(&data[..RING]).await.unwrap();
        });
        let n = n.unwrap();
        assert!((1..=SMALL).contains(&n), "{n}");
        let left_in_ring = s.stats().bytes_buffered == buffered_before;
        let mut got = small[..n].to_vec();
        // The server's reader sleeps: the rest goes out only if the bytes
        // it left are moved out without a read (a liveness bound, not a
        // speed check).
        let mut reply_got = vec![0u8; reply.len()];
        {
            let (mut crd, mut cwr) = c.split();
            let (_srd, mut swr) = s.split();
            let (w, (r, sw)) = tokio::time::timeout(Duration::from_secs(120), async {
                tokio::join!(cwr.write_all(&data[RING..]), async {
                    tokio::join!(crd.read_exact(&mut reply_got), swr.write_all(&reply))
                })
            })
            .await
            .expect("the writer finished while the reader slept");
            w.unwrap();
            r.unwrap();
            sw.unwrap();
        }
        assert!(reply_got == reply, "reply bytes differ");
        let moved_while_asleep = s.stats().bytes_buffered - buffered_before;
        c.shutdown().await.unwrap();
        s.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), LEN);
        assert!(got == data, "delivered bytes differ");
        let stats = s.stats();
        assert_eq!(stats.bytes_received, LEN as u64 + 1);
        if left_in_ring {
            // When the write finished, at most the client's send buffer
            // and the server's ring held bytes not moved out, and the
            // reader had taken SMALL bytes at most: the driver moved out
            // the rest. The server's ring may have grown (its reply's
            // CREDITs keep its driver busy), and then the client's send
            // buffer followed it: both are read from the stats, not
            // assumed to be RING.
            // While a grown ring replaces the previous one, both can hold
            // bytes (the old one until the reader's side has read it out).
            let old_ring = if stats.rings_grown > 0 {
                RING as u64
            } else {
                0
            };
            let in_flight =
                u64::from(stats.ring_size) + old_ring + u64::from(c.stats().send_buffer_size);
            let at_least = (LEN as u64).saturating_sub(in_flight + SMALL as u64);
            assert!(
                (at_least..=LEN as u64).contains(&moved_while_asleep),
                "{moved_while_asleep} moved while asleep (at least {at_least}), {stats:?}"
            );
            println!("bytes left in the ring by a read on attempt {attempts}");
            break;
        }
        assert!(
            attempts < 10,
            "no read took bytes straight from the ring in 10 connections"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_right_after_write_all_delivers_everything() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let data: Vec<u8> = (0..(1u64 << 20)).map(|i| pattern(5, i)).collect();
    let mut c = RdmaStream::connect(addr).await.unwrap();
    let (s, _) = l.accept().await.unwrap();
    c.write_all(&data).await.unwrap();
    drop(c);
    let mut s = s;
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got.len(), data.len());
    assert!(got == data, "delivered bytes differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_without_listener_is_refused() {
    let err = RdmaStream::connect(format!("{IP}:1")).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(
        matches!(inner, Some(Error::ConnectionRefused { .. })),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_raced_against_timer_loses_nothing() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let clients = tokio::spawn(async move {
        for i in 0..20u8 {
            let mut s = RdmaStream::connect(addr).await.unwrap();
            s.write_all(&[i]).await.unwrap();
            s.shutdown().await.unwrap();
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).await.unwrap();
            assert_eq!(ack[0], i);
        }
    });
    let mut seen = Vec::new();
    let mut timeouts = 0u32;
    while seen.len() < 20 {
        tokio::select! {
            r = l.accept() => {
                let (mut s, _) = r.unwrap();
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await.unwrap();
                s.write_all(&b).await.unwrap();
                seen.push(b[0]);
            }
            _ = tokio::time::sleep(Duration::from_micros(500)) => timeouts += 1,
        }
    }
    clients.await.unwrap();
    assert_eq!(seen, (0..20u8).collect::<Vec<_>>());
    assert!(timeouts > 0, "the timer branch must have won some races");
}

/// A listener whose own connect timeout (1 ms) is shorter than any
/// handshake in this guest still accepts every client: it waits for the
/// kernel CM's verdict, so a client that counts itself connected (it sent
/// its RTU) is never disconnected by a slow listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_with_a_short_connect_timeout_still_accepts() {
    let cfg = RdmaConfig::default().connect_timeout(Duration::from_millis(1));
    let l = bind(&cfg).await;
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        for _ in 0..5 {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 8];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(&b).await.unwrap();
            s.shutdown().await.unwrap();
        }
    });
    for i in 0..5u64 {
        let mut s = RdmaStream::connect(addr).await.unwrap();
        s.write_all(&i.to_le_bytes()).await.unwrap();
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, i.to_le_bytes());
    }
    server.await.unwrap();
}

fn hello_bytes(magic: u32, version: u16) -> Vec<u8> {
    let mut h = vec![0u8; 32];
    h[0..4].copy_from_slice(&magic.to_be_bytes());
    h[4..6].copy_from_slice(&version.to_be_bytes());
    h[6] = 1; // byte stream
    h[8..16].copy_from_slice(&0x1000u64.to_be_bytes());
    h[16..20].copy_from_slice(&1u32.to_be_bytes());
    h[20..24].copy_from_slice(&65536u32.to_be_bytes());
    h[24..26].copy_from_slice(&64u16.to_be_bytes());
    h
}

/// The wire protocol version this build speaks (`proto::handshake::VERSION`,
/// crate-private): 12 since the hello's byte 28 carries the port's MTU.
const PROTOCOL_VERSION: u16 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_handshakes_are_rejected_and_listener_keeps_serving() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        echo(s).await.unwrap()
    });
    // A valid hello but for its path MTU code (6: no such `ibv_mtu`).
    let mut bad_mtu = hello_bytes(0x544B_5244, PROTOCOL_VERSION);
    bad_mtu[28] = 6;
    let cases: [(Vec<u8>, RejectReason); 4] = [
        (hello_bytes(0xDEAD_BEEF, 1), RejectReason::BadMagic),
        (bad_mtu, RejectReason::Malformed),
        (
            hello_bytes(0x544B_5244, 99),
            RejectReason::UnsupportedVersion,
        ),
        (
            // rdma_cm pads it to 56 zero bytes: a current hello whose ring
            // is 0.
            hello_bytes(0x544B_5244, PROTOCOL_VERSION)[..10].to_vec(),
            RejectReason::Malformed,
        ),
    ];
    for (bytes, want) in cases {
        match tokio_rdma::__testing::connect_with_private_data(addr, &bytes).await {
            Err(Error::HandshakeRejected {
                reason,
                server_version,
                ..
            }) => {
                assert_eq!(reason, want);
                assert_eq!(
                    server_version, PROTOCOL_VERSION,
                    "the protocol version this build speaks"
                );
            }
            other => panic!("expected a reject with {want:?}, got {other:?}"),
        }
    }
    let s = RdmaStream::connect(addr).await.unwrap();
    assert_eq!(echo_roundtrip(s, 1, 4096, 4096).await.unwrap(), 4096);
    assert_eq!(server.await.unwrap(), 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_process_is_an_error_not_eof() {
    let echo_bin = example("echo");
    let addr: SocketAddr = format!("{IP}:7633").parse().unwrap();
    let mut child = tokio::process::Command::new(&echo_bin)
        .args(["server", &addr.to_string()])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut s = None;
    for _ in 0..1200 {
        match RdmaStream::connect(addr).await {
            Ok(c) => {
                s = Some(c);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let s = s.expect("echo server came up");
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let buf = vec![0x5Au8; 16 * 1024];
        loop {
            if let Err(e) = wr.write_all(&buf).await {
                return e;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0usize;
    while got < 1 << 20 {
        let n = rd.read(&mut buf).await.unwrap();
        assert!(n > 0, "EOF before the kill");
        got += n;
    }
    child.kill().await.unwrap();
    let read_err = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match rd.read(&mut buf).await {
                Ok(0) => panic!("EOF after the peer was killed: must be an error"),
                Ok(_) => continue,
                Err(e) => return e,
            }
        }
    })
    .await
    .expect("the read must fail within 60 s");
    assert!(
        matches!(
            read_err.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
        ),
        "{read_err:?}"
    );
    let write_err = tokio::time::timeout(Duration::from_secs(60), writer)
        .await
        .expect("the write must fail within 60 s")
        .unwrap();
    assert!(
        matches!(
            write_err.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
        ),
        "{write_err:?}"
    );
}

/// Starts `examples/echo` serving on `addr`, and connects once it listens
/// (a server that could not bind yet exits and is started again).
async fn echo_server_and_client(addr: SocketAddr) -> (tokio::process::Child, RdmaStream) {
    let echo_bin = example("echo");
    let spawn = || {
        tokio::process::Command::new(&echo_bin)
            .args(["server", &addr.to_string()])
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let mut child = spawn();
    for _ in 0..1200 {
        if let Ok(c) = RdmaStream::connect(addr).await {
            return (child, c);
        }
        if child.try_wait().unwrap().is_some() {
            child = spawn();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the echo server never came up on {addr}");
}

/// A server process killed and started again on the same port while a
/// connection of its first life still stands (the item of the
/// device/link issue "a peer restarting on the same address"): new
/// connections reach the new process and echo exactly, and the old one
/// fails with `ConnectionReset`/`ConnectionAborted` (never EOF, never the
/// new process's bytes) within 60 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restarted_on_the_same_port_serves_while_the_old_connection_fails() {
    let addr: SocketAddr = format!("{IP}:7641").parse().unwrap();
    let (mut first, mut old) = echo_server_and_client(addr).await;
    old.write_all(b"first life").await.unwrap();
    let mut back = [0u8; 10];
    old.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"first life");
    first.kill().await.unwrap();
    let (_second, new) = echo_server_and_client(addr).await;
    let (mut rd, mut wr) = new.into_split();
    let data: Vec<u8> = (0..65_536u32).map(|i| (i % 251) as u8).collect();
    let expect = data.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&data).await.unwrap();
        wr.shutdown().await.unwrap();
    });
    let mut echoed = Vec::new();
    rd.read_to_end(&mut echoed).await.unwrap();
    writer.await.unwrap();
    assert!(echoed == expect, "the new process's echo");
    let mut buf = [0u8; 64];
    let old_err = match tokio::time::timeout(Duration::from_secs(60), old.read(&mut buf))
        .await
        .expect("the old connection fails within 60 s")
    {
        Ok(0) => panic!("EOF on the old connection: must be an error"),
        Ok(n) => panic!("{n} bytes on the old connection after its server died"),
        Err(e) => e,
    };
    assert!(
        matches!(
            old_err.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
        ),
        "{old_err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linger_gives_up_on_a_peer_that_never_reads() {
    // The server's ring (8191 bytes) fills and is never drained; the client
    // drops with 5003 more bytes in its send buffer and a 1 s linger.
    let server_cfg = RdmaConfig::new().ring_size(8191).recv_buffer_limit(0);
    let client_cfg = RdmaConfig::new()
        .send_buffer_size(5003)
        .linger(Duration::from_secs(1));
    let l = bind(&server_cfg).await;
    let addr = l.local_addr().unwrap();
    let mut c = RdmaStream::connect_with(addr, &client_cfg).await.unwrap();
    let (mut s, _) = l.accept().await.unwrap();
    let data: Vec<u8> = (0..(8191 + 5003) as u64).map(|i| pattern(11, i)).collect();
    c.write_all(&data).await.unwrap();
    drop(c);
    // Once the linger ran out the client tears its end down: only the
    // server's QP is left (the suite runs one test at a time).
    let start = std::time::Instant::now();
    while tokio_rdma::stats::resources().queue_pairs > 1 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the client's end outlived its 1 s linger by a minute"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let err = loop {
        match s.read(&mut buf).await {
            Ok(0) => panic!("EOF: the client never sent its FIN, so this must be an error"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
    assert_eq!(got.len(), 8191, "exactly the ring's worth arrived");
    assert!(got == data[..8191], "the delivered prefix is intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_config_fails_at_bind_and_connect() {
    let bad = RdmaConfig::new().signal_interval(0);
    let err = RdmaListener::bind_with(format!("{IP}:0"), &bad)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    let err = RdmaStream::connect_with(format!("{IP}:1"), &bad)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(
        matches!(
            inner,
            Some(Error::InvalidConfig {
                field: "signal_interval",
                value: 0,
                ..
            })
        ),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_bounds_unaccepted_connections() {
    let l = bind(&RdmaConfig::new().backlog(2)).await;
    let addr = l.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(RdmaStream::connect(addr).await.unwrap());
    }
    // Both hold a backlog slot until accepted; a third connect retries the
    // busy rejects for its whole connect timeout (5 s here), then refuses.
    let short = RdmaConfig::new().connect_timeout(Duration::from_secs(5));
    match RdmaStream::connect_with(addr, &short).await {
        Err(e) => {
            assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
            let inner = e.get_ref().and_then(|e| e.downcast_ref::<Error>());
            assert!(
                matches!(
                    inner,
                    Some(Error::HandshakeRejected {
                        reason: RejectReason::ServerResources,
                        ..
                    })
                ),
                "{e:?}"
            );
        }
        Ok(_) => panic!("a third connection got past a backlog of 2"),
    }
    // Accepting one frees a slot.
    let (_s1, _) = l.accept().await.unwrap();
    let third = RdmaStream::connect(addr).await.unwrap();
    let (_s2, _) = l.accept().await.unwrap();
    let (_s3, _) = l.accept().await.unwrap();
    drop((held, third));
}

/// A burst well above the default backlog (128) connects, as TCP clients
/// whose SYNs were dropped do: busy rejects are retried with backoff inside
/// the connect timeout while the server accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_512_connects_above_the_backlog_all_connect() {
    const N: usize = 512;
    let cfg = RdmaConfig::new().connect_timeout(Duration::from_secs(120));
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut accepted = Vec::with_capacity(N);
        while accepted.len() < N {
            accepted.push(l.accept().await.unwrap().0);
        }
        accepted
    });
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..N {
        let cfg = cfg.clone();
        tasks.spawn(async move { RdmaStream::connect_with(addr, &cfg).await });
    }
    let mut connected = Vec::with_capacity(N);
    while let Some(r) = tasks.join_next().await {
        connected.push(r.unwrap().expect("every connect of the burst succeeds"));
    }
    assert_eq!(connected.len(), N);
    let accepted = tokio::time::timeout(Duration::from_secs(120), server)
        .await
        .expect("the server accepts them all")
        .unwrap();
    assert_eq!(accepted.len(), N);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_owned_write_half_half_closes() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let c = RdmaStream::connect(addr).await.unwrap();
    let (mut s, _) = l.accept().await.unwrap();
    let (mut rd, mut wr) = c.into_split();
    wr.write_all(b"payload").await.unwrap();
    drop(wr); // like tokio: half-close, while the read half lives on
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut got))
        .await
        .expect("EOF after the write half was dropped")
        .unwrap();
    assert_eq!(got, b"payload");
    s.write_all(b"reply").await.unwrap();
    s.shutdown().await.unwrap();
    let mut reply = Vec::new();
    rd.read_to_end(&mut reply).await.unwrap();
    assert_eq!(reply, b"reply");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_listener_frees_its_port_at_once() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    drop(l);
    let l2 = RdmaListener::bind(addr)
        .await
        .expect("rebind right after drop");
    assert_eq!(l2.local_addr().unwrap(), addr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_without_rdma_route_is_unreachable() {
    let err = RdmaStream::connect("127.0.0.1:1").await.unwrap_err();
    let inner = err.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(matches!(inner, Some(Error::Unreachable { .. })), "{err:?}");
    // The kernel's address resolution answers ENODEV (no RDMA device has
    // 127.0.0.1) with rxe, EINVAL with siw present.
    let want = if common::iwarp() {
        io::ErrorKind::HostUnreachable
    } else {
        io::ErrorKind::NotFound
    };
    assert_eq!(err.kind(), want, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_bind_is_refused_with_a_typed_error() {
    let err = RdmaListener::bind("127.0.0.1:0").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::AddrNotAvailable, "{err}");
    assert!(
        matches!(Error::from_io(&err), Some(Error::NoDeviceForAddress { addr }) if addr.is_loopback()),
        "{err:?}"
    );
}

// ---- A peer process that stops or dies (SIGSTOP / SIGKILL) --------------

/// Starts `examples/echo server` on `port` and connects to it.
async fn echo_child(port: u16, cfg: &RdmaConfig) -> (tokio::process::Child, RdmaStream) {
    let addr = format!("{IP}:{port}");
    let child = tokio::process::Command::new(example("echo"))
        .args(["server", &addr])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    for _ in 0..1200 {
        if let Ok(s) = RdmaStream::connect_with(addr.as_str(), cfg).await {
            return (child, s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the echo server at {addr} did not come up");
}

/// The QPs on this host (`rdma resource show qp`, one line per QP).
fn qp_count() -> usize {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", "qp"])
        .output()
        .expect("the rdma tool (iproute2) runs in the guest");
    assert!(out.status.success(), "rdma resource show qp");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("lqpn"))
        .count()
}

async fn wait_qp_count(want: usize) {
    for _ in 0..400 {
        if qp_count() == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(qp_count(), want, "every QP freed");
}

/// Ring (64 KiB) plus send buffer (64 KiB) with the default config: what
/// a stopped peer's NIC and our buffer take before a write blocks.
const FULL: usize = 128 * 1024;

fn pattern_buf(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern(seed, i)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_stopped_peer_returns_at_once_and_delivers_on_resume() {
    let (child, mut s) = echo_child(7711, &RdmaConfig::default()).await;
    signal(&child, "STOP");
    let data = pattern_buf(11, FULL);
    tokio::time::timeout(Duration::from_secs(30), s.write_all(&data))
        .await
        .expect("ring + send buffer take 128 KiB with the peer stopped")
        .unwrap();
    // TCP parity: shutdown queues the FIN behind the buffered bytes and
    // returns; it does not wait for credit a stopped peer cannot return.
    tokio::time::timeout(Duration::from_secs(10), s.shutdown())
        .await
        .expect("shutdown returns while the peer is stopped")
        .unwrap();
    let err = s.write_all(b"x").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    assert!(matches!(
        Error::from_io(&err),
        Some(Error::WriteAfterShutdown)
    ));
    signal(&child, "CONT");
    let mut back = Vec::with_capacity(FULL);
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut back))
        .await
        .expect("the resumed peer echoes everything, then its FIN")
        .unwrap();
    assert_eq!(back.len(), FULL);
    assert!(back == data, "echoed bytes equal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_stream_with_a_killed_peer_frees_everything() {
    let before = qp_count();
    let (mut child, mut s) = echo_child(7712, &RdmaConfig::default()).await;
    signal(&child, "STOP");
    tokio::time::timeout(Duration::from_secs(30), s.write_all(&pattern_buf(12, FULL)))
        .await
        .expect("writes fit while the peer is stopped")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), s.shutdown())
        .await
        .expect("shutdown returns at once")
        .unwrap();
    // Delivery of the last 64 KiB and the FIN goes on in the background...
    drop(s);
    // ...until the peer dies: then it gives up and frees the QP.
    child.kill().await.unwrap();
    wait_qp_count(before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_wakes_a_blocked_reader_and_a_blocked_writer() {
    killed_peer_wakes_both(7713, &RdmaConfig::default()).await;
}

/// Connections past the 64 that get a completion channel of their own
/// keep the stream's semantics, both kinds: a CQ of their own reporting to
/// the runtime's channel (the default), and a seat on a CQ shared with up
/// to 59 other QPs (`share_completion_queue`). 70 held connections (140
/// ends in this process) take the 64; then for each kind a new connection
/// echoes 1 MiB across ring wraps, 20 connections in turn each echo 64 KiB
/// and close (on shared CQs their seats and routes are given back: the
/// shared CQ count ends where it started), and one to a peer process that
/// is stopped and killed wakes its blocked reader and writer with errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_64_on_own_and_shared_cqs_behave_the_same() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..70 {
        let (c, s) = tokio::join!(RdmaStream::connect(addr), l.accept());
        held.push(c.unwrap());
        held.push(s.unwrap().0);
    }
    let start = tokio_rdma::stats::resources();
    assert_eq!(start.completion_channels, 64);
    assert_eq!(start.shared_completion_queues, 0);
    drop(l);
    for (share, child_port) in [(false, 7719), (true, 7720)] {
        let cfg = RdmaConfig::default().share_completion_queue(share);
        let l = bind(&cfg).await;
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let echoed = echo(s).await;
            for _ in 0..20 {
                let (s, _) = l.accept().await.unwrap();
                assert_eq!(echo(s).await.unwrap(), 64 * 1024);
            }
            echoed
        });
        let c = RdmaStream::connect_with(addr, &cfg).await.unwrap();
        // Both ends of this connection on one shared CQ, or each on a CQ of
        // its own.
        let now = tokio_rdma::stats::resources();
        assert_eq!(now.shared_completion_queues, u64::from(share), "{now:?}");
        assert_eq!(
            echo_roundtrip(c, 21, 1 << 20, 10_000).await.unwrap(),
            1 << 20
        );
        for seed in 0..20 {
            let c = RdmaStream::connect_with(addr, &cfg).await.unwrap();
            assert_eq!(
                echo_roundtrip(c, seed, 64 * 1024, 4096).await.unwrap(),
                64 * 1024
            );
        }
        assert_eq!(server.await.unwrap().unwrap(), 1 << 20);
        killed_peer_wakes_both(child_port, &cfg).await;
    }
    let now = tokio_rdma::stats::resources();
    assert_eq!(now.completion_channels, 64);
    // The last shared CQ went with its last connection.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while tokio_rdma::stats::resources().shared_completion_queues != 0
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tokio_rdma::stats::resources().shared_completion_queues, 0);
    drop(held);
}

/// A stream to an echo child that is stopped, then killed: a blocked
/// reader gets ConnectionReset and a blocked writer BrokenPipe or
/// ConnectionReset, both typed.
async fn killed_peer_wakes_both(port: u16, cfg: &RdmaConfig) {
    let (mut child, s) = echo_child(port, cfg).await;
    signal(&child, "STOP");
    let (mut rd, mut wr) = s.into_split();
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        rd.read(&mut buf).await
    });
    let writer = tokio::spawn(async move {
        let chunk = pattern_buf(13, 64 * 1024);
        loop {
            if let Err(e) = wr.write_all(&chunk).await {
                return e;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!reader.is_finished(), "nothing to read from a stopped peer");
    assert!(!writer.is_finished(), "the writer blocks on full buffers");
    child.kill().await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), reader)
        .await
        .expect("the reader is woken")
        .unwrap();
    let w = tokio::time::timeout(Duration::from_secs(20), writer)
        .await
        .expect("the writer is woken")
        .unwrap();
    let r = r.expect_err("a vanished peer is an error for the reader, never EOF");
    assert_eq!(r.kind(), io::ErrorKind::ConnectionReset, "{r}");
    assert!(Error::from_io(&r).is_some(), "typed: {r:?}");
    assert!(
        matches!(
            w.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        ),
        "{w}"
    );
    assert!(Error::from_io(&w).is_some(), "typed: {w:?}");
}

// ---- Isolation between connections ---------------------------------------

/// Makes `forger` post a 64-byte RDMA WRITE WITH IMM to `addr`/`key` at its
/// peer and checks that its connection then fails with a remote access
/// error (REM_ACCESS_ERR, status 10), never data or EOF.
async fn assert_forged_write_refused(forger: &mut RdmaStream, addr: u64, key: u32) {
    tokio_rdma::__testing::forge_ring_write(forger, addr, key, 64).unwrap();
    let mut one = [0u8; 1];
    let err = tokio::time::timeout(Duration::from_secs(30), forger.read(&mut one))
        .await
        .expect("the forger's connection fails")
        .expect_err("a remote access error, not data or EOF");
    if common::iwarp() {
        // iWARP completes a WRITE once TCP took its bytes: the responder's
        // TERMINATE (a bad STag) moves the forger's QP to the error state,
        // and its receive WRs are flushed; the responder's disconnect may
        // reach the forger before the flushed completions are polled.
        assert!(
            matches!(
                Error::from_io(&err),
                Some(Error::WorkCompletion {
                    status: 5,
                    op: "receive"
                }) | Some(Error::PeerDisconnected)
            ),
            "a flushed receive or the disconnect expected on iWARP: {err:?}"
        );
        return;
    }
    assert!(
        matches!(
            Error::from_io(&err),
            Some(Error::WorkCompletion { status: 10, .. })
        ),
        "REM_ACCESS_ERR expected: {err:?}"
    );
}

/// A key learnt (or guessed) for one connection's receive ring is useless
/// on any other connection: the ring is opened through a memory window
/// bound to its own QP. A forged RDMA WRITE with another connection's ring
/// key fails with a remote access error, and that connection's data is
/// intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_key_is_useless_from_another_connection() {
    let l = bind(&RdmaConfig::default()).await;
    let addr = l.local_addr().unwrap();
    let (a, s1) = tokio::join!(RdmaStream::connect(addr), l.accept());
    let (mut a, (_s1, _)) = (a.unwrap(), s1.unwrap());
    let (b, s2) = tokio::join!(RdmaStream::connect(addr), l.accept());
    let (b, (s2, _)) = (b.unwrap(), s2.unwrap());
    // A memory window bound on s2's QP, or (a device without windows) a
    // PD of s2's QP's own: either way the key is s2's QP's alone.
    let want = if common::iwarp() {
        tokio_rdma::RemoteAccess::OwnProtectionDomain
    } else {
        tokio_rdma::RemoteAccess::MemoryWindow
    };
    assert_eq!(s2.stats().remote_access, want);
    let (ring_addr, ring_key) = tokio_rdma::__testing::ring_key(&s2);
    // `a` writes through its own connection (to s1) with s2's ring key.
    assert_forged_write_refused(&mut a, ring_addr, ring_key).await;
    // s2's connection is untouched: an echo over it is byte for byte.
    let server = tokio::spawn(echo(s2));
    assert_eq!(
        echo_roundtrip(b, 21, 256 * 1024, 4096).await.unwrap(),
        256 * 1024
    );
    assert_eq!(server.await.unwrap().unwrap(), 256 * 1024);
}

/// An idle connection probes its peer (keepalive 1 s here): the probes
/// (zero-length RDMA WRITEs; READs on iWARP) are answered and change
/// nothing, so after
/// several idle periods the stream carries data as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_probes_keep_an_idle_stream_intact() {
    let cfg = RdmaConfig::new().keepalive(Some(Duration::from_secs(1)));
    let l = bind(&cfg).await;
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(RdmaStream::connect_with(addr, &cfg), l.accept());
    let (c, (s, _)) = (c.unwrap(), s.unwrap());
    let before = c.stats();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let after = c.stats();
    assert_eq!(after.errors, 0);
    assert_eq!(after.bytes_sent, before.bytes_sent, "probes carry no data");
    let server = tokio::spawn(echo(s));
    assert_eq!(
        echo_roundtrip(c, 31, 64 * 1024, 4096).await.unwrap(),
        64 * 1024
    );
    assert_eq!(server.await.unwrap().unwrap(), 64 * 1024);
}

/// Lock-step 64 B ping-pong on the multi-thread runtime, four connections
/// at once, each way waiting by parking and by the default spin, with
/// keepalive off: a wake-up lost between the driver task, a reader and a
/// writer (an event taken with nobody left to re-arm the CQ) would stop a
/// ping-pong for good, as nothing else wakes the connection (the 120 s
/// bound is a hang detector, not a speed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_thread_lock_step_ping_pongs_never_stall() {
    const ROUND_TRIPS: u64 = 4000;
    for wait in [WaitStrategy::Park, WaitStrategy::default()] {
        let cfg = RdmaConfig::new().keepalive(None).wait_strategy(wait);
        let l = bind(&cfg).await;
        let addr = l.local_addr().unwrap();
        let server = echo_accepted(l, 4);
        let clients: Vec<_> = (0..4u64)
            .map(|c| {
                let cfg = cfg.clone();
                tokio::spawn(async move {
                    let mut s = RdmaStream::connect_with(addr, &cfg).await.unwrap();
                    let mut req = [0u8; 64];
                    let mut resp = [0u8; 64];
                    for i in 0..ROUND_TRIPS {
                        for (k, b) in req.iter_mut().enumerate() {
                            *b = pattern(c, i * 64 + k as u64);
                        }
                        s.write_all(&req).await.unwrap();
                        s.read_exact(&mut resp).await.unwrap();
                        assert_eq!(resp, req, "connection {c}, round trip {i}");
                    }
                    let stats = s.stats();
                    s.shutdown().await.unwrap();
                    assert_eq!(s.read(&mut resp).await.unwrap(), 0, "EOF after the echo");
                    stats
                })
            })
            .collect();
        let done = tokio::time::timeout(Duration::from_secs(120), async {
            let mut stats = Vec::new();
            for c in clients {
                stats.push(c.await.unwrap());
            }
            stats
        })
        .await
        .expect("every ping-pong finishes (a lost wake-up stalls one)");
        for st in &done {
            assert_eq!(st.bytes_sent, ROUND_TRIPS * 64);
            assert_eq!(st.bytes_received, ROUND_TRIPS * 64);
            assert_eq!(st.errors, 0);
        }
        assert_eq!(server.await.unwrap(), 4 * ROUND_TRIPS * 64);
    }
}

/// Connections on different tokio runtimes (a runtime's CQs report to a
/// completion channel of its own): a current_thread runtime's connection
/// and a multi-thread runtime's echo 1 MiB each concurrently; the first
/// runtime shuts down; the second's new connections still echo, and so do
/// a third runtime's (which may get the first one's runtime id).
#[test]
fn connections_on_three_runtimes_one_shut_down() {
    const LEN: u64 = 1 << 20;
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let l = multi.block_on(bind(&RdmaConfig::new()));
    let addr = l.local_addr().unwrap();
    let l = std::sync::Arc::new(l);
    let server = {
        let l = std::sync::Arc::clone(&l);
        multi.spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                tokio::spawn(echo(s));
            }
        })
    };
    let on_own_runtime = |seed: u64| {
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let got = rt.block_on(async move {
                let s = RdmaStream::connect(addr).await.unwrap();
                echo_roundtrip(s, seed, LEN, 64 * 1024).await.unwrap()
            });
            drop(rt);
            got
        })
    };
    let first = on_own_runtime(1);
    let on_multi = multi.block_on(async move {
        let s = RdmaStream::connect(addr).await.unwrap();
        echo_roundtrip(s, 2, LEN, 64 * 1024).await.unwrap()
    });
    assert_eq!(on_multi, LEN);
    assert_eq!(
        first.join().unwrap(),
        LEN,
        "the current_thread runtime's echo"
    );
    // The first runtime is gone (with its connection and hub).
    let again = multi.block_on(async move {
        let s = RdmaStream::connect(addr).await.unwrap();
        echo_roundtrip(s, 3, LEN, 64 * 1024).await.unwrap()
    });
    assert_eq!(again, LEN);
    assert_eq!(on_own_runtime(4).join().unwrap(), LEN, "a third runtime");
    server.abort();
    drop(multi);
}

/// The wait strategies on the real data path, 200 round trips of 64 B
/// each: with a 2 s spin budget every read that finds nothing is answered
/// while spinning (no read parks, on either end); parking at once never
/// counts a spin. Both ends report the strategy's limit
/// (`spin_limit_us`). The server runs on a thread and runtime of its own,
/// so a spinning client never holds it up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_strategies_spin_or_park_as_configured() {
    const ROUNDS: u64 = 200;
    for strategy in [
        WaitStrategy::Spin(Duration::from_secs(2)),
        WaitStrategy::Park,
    ] {
        let cfg = RdmaConfig::new().wait_strategy(strategy);
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        // The server's runtime ends with its thread, which would cut its
        // connection short: it stays until the client has read its EOF.
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let server_cfg = cfg.clone();
        let server = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("server runtime");
            rt.block_on(async move {
                let listener = bind(&server_cfg).await;
                addr_tx
                    .send(listener.local_addr()?)
                    .expect("address to the test");
                let (mut s, _) = listener.accept().await?;
                let mut buf = [0u8; 64];
                let mut echoed = 0u64;
                loop {
                    match s.read_exact(&mut buf).await {
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                        Err(e) => return Err(e),
                    }
                    s.write_all(&buf).await?;
                    echoed += 1;
                }
                s.shutdown().await?;
                let _ = done_rx.await;
                Ok::<_, io::Error>((echoed, s.stats()))
            })
        });
        let addr: SocketAddr = addr_rx.recv().expect("the server's address");
        let mut c = RdmaStream::connect_with(addr, &cfg).await.expect("connect");
        let mut back = [0u8; 64];
        for round in 0..ROUNDS {
            let req: Vec<u8> = (0..64).map(|i| pattern(round, i)).collect();
            c.write_all(&req).await.expect("write");
            c.read_exact(&mut back).await.expect("read the echo");
            assert_eq!(&back[..], &req[..], "round {round}");
        }
        c.shutdown().await.expect("shutdown");
        assert_eq!(c.read(&mut back).await.expect("EOF"), 0);
        done_tx.send(()).expect("the server waits");
        let client = c.stats();
        let (echoed, server) = server.join().expect("server thread").expect("server");
        assert_eq!(echoed, ROUNDS);
        // the limit each end reports: the fixed budget, or 0 for parking
        let limit_us = match strategy {
            WaitStrategy::Spin(d) => d.as_micros() as u64,
            _ => 0,
        };
        assert_eq!(
            (client.spin_limit_us, server.spin_limit_us),
            (limit_us, limit_us),
            "{strategy:?}"
        );
        match strategy {
            WaitStrategy::Park => {
                assert_eq!((client.spin_hits, server.spin_hits), (0, 0), "{strategy:?}");
                assert!(
                    client.read_parks > 0 && server.read_parks > 0,
                    "{client:?} {server:?}"
                );
                // The server's driver left the events of its parked reads
                // to the reader (its channel is its own); an event follows
                // at least one completion.
                assert!(
                    server.events_left_to_reader > 0
                        && server.events_left_to_reader <= server.completions,
                    "{server:?}"
                );
            }
            _ => {
                assert_eq!(
                    (client.read_parks, server.read_parks),
                    (0, 0),
                    "{strategy:?}"
                );
                // every read that waited was answered while spinning (a read
                // whose answer was already there did not wait)
                assert!(
                    client.spin_hits > 0 && client.spin_hits <= ROUNDS + 1,
                    "{client:?}"
                );
                assert!(
                    server.spin_hits > 0 && server.spin_hits <= ROUNDS + 1,
                    "{server:?}"
                );
            }
        }
    }
}

/// How the server's reader stops reading in [`driver_takes_over_after`].
#[derive(Clone, Copy, Debug)]
enum ReaderStop {
    /// A read parked on the CQ is dropped (a `select!` that took its other
    /// branch): it takes no more events.
    DroppedWhileParked,
    /// A parked read is answered (one byte, 9) and no read follows: the
    /// reader found its data after an event and left the CQ unarmed.
    AnsweredThenIdle,
}

/// The server echoes 64 B pings until its driver leaves completion events
/// to its (parked) reader, then its reader stops as `stop` says, and the
/// client writes 16 rings' worth with a 4 KiB send buffer: the write
/// completes only if the server's driver takes over within its ticks,
/// draining the bytes into process memory and crediting them back without
/// one read. Every byte must then arrive intact.
async fn driver_takes_over_after(stop: ReaderStop, seed: u64) {
    const RING: usize = 8192;
    const BULK: usize = 16 * RING;
    let cfg = RdmaConfig::new()
        .ring_size(RING as u32)
        .recv_buffer_limit(1 << 20)
        .wait_strategy(WaitStrategy::Park);
    let l = bind(&cfg).await;
    let addr = l.local_addr().unwrap();
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let (sent_tx, sent_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await?;
        // Echo pings until the driver leaves events to the reader; the
        // last echo says so (first byte 1).
        let mut buf = [0u8; 64];
        loop {
            s.read_exact(&mut buf).await?;
            let delegated = s.stats().events_left_to_reader > 0;
            buf[0] = u8::from(delegated);
            s.write_all(&buf).await?;
            if delegated {
                break;
            }
        }
        let mut one = [0u8; 1];
        match stop {
            ReaderStop::DroppedWhileParked => tokio::select! {
                r = s.read(&mut one) => panic!("nothing was sent yet: {r:?}"),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            },
            ReaderStop::AnsweredThenIdle => {
                s.read_exact(&mut one).await?;
                assert_eq!(one, [9]);
            }
        }
        stopped_tx.send(()).expect("the client waits");
        sent_rx.await.expect("the client wrote");
        let mut all = Vec::new();
        s.read_to_end(&mut all).await?;
        Ok::<_, io::Error>(all)
    });
    // A small send buffer: the bulk write completes only once the server
    // took all but 4 KiB + its ring.
    let client_cfg = cfg.clone().send_buffer_size(4096);
    let mut c = RdmaStream::connect_with(addr, &client_cfg).await.unwrap();
    let mut back = [0u8; 64];
    let mut pings = 0u32;
    loop {
        c.write_all(&[0u8; 64]).await.unwrap();
        c.read_exact(&mut back).await.unwrap();
        pings += 1;
        if back[0] == 1 {
            break;
        }
        assert!(
            pings < 10_000,
            "the server's driver never left an event to its reader"
        );
    }
    if let ReaderStop::AnsweredThenIdle = stop {
        // Let the server's read park first.
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.write_all(&[9]).await.unwrap();
    }
    stopped_rx.await.expect("the server's reader stopped");
    let bulk: Vec<u8> = (0..BULK as u64).map(|i| pattern(seed, i)).collect();
    // Without the driver's rounds the server's ring stays full after the
    // first 8 KiB and this write never completes.
    tokio::time::timeout(Duration::from_secs(30), c.write_all(&bulk))
        .await
        .expect("the server's driver drained and credited without a read")
        .expect("write");
    sent_tx.send(()).expect("the server waits");
    c.shutdown().await.unwrap();
    let all = server.await.unwrap().expect("server");
    assert_eq!(all.len(), BULK);
    assert!(all == bulk, "the bytes arrived changed");
}

/// A read dropped while parked on the CQ takes no more events; the driver,
/// which had been leaving them to it, takes over within its tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_while_parked_leaves_progress_to_the_driver() {
    driver_takes_over_after(ReaderStop::DroppedWhileParked, 77).await;
}

/// A reader woken by an event that finds its data leaves the CQ unarmed,
/// and a driver that leaves events to it does not arm either: when that
/// reader then stops reading, the driver still takes over within its
/// ticks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_after_a_parked_read_leaves_progress_to_the_driver() {
    driver_takes_over_after(ReaderStop::AnsweredThenIdle, 78).await;
}

// ---- Receive rings that grow under bulk -------------------------------------

/// Writes `len` pattern bytes in 64 KiB writes and closes.
async fn write_pattern(mut s: RdmaStream, seed: u64, len: u64) -> io::Result<RdmaStream> {
    let mut sent = 0u64;
    while sent < len {
        let n = (len - sent).min(64 * 1024);
        let buf: Vec<u8> = (0..n).map(|k| pattern(seed, sent + k)).collect();
        s.write_all(&buf).await?;
        sent += n;
    }
    s.shutdown().await?;
    Ok(s)
}

/// Reads to EOF in 64 KiB reads, checking every byte; returns the count.
async fn read_pattern(s: &mut RdmaStream, seed: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(got);
        }
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, pattern(seed, got + k as u64), "byte {}", got + k as u64);
        }
        got += n as u64;
    }
}

/// A bulk stream whose reader keeps up grows the receive ring from 64 KiB
/// to `max_ring_size` (128 KiB here: one doubling; 64 KiB writes fill a
/// 64 KiB ring with every WR, so the fill cycles are certain), every byte
/// arriving once and in order across the switch; the ring it left is
/// freed (the reader holds exactly the 128 KiB ring), and the writer's own
/// ring, which received nothing, stays at 64 KiB. The writer's send
/// buffer follows the reader's ring to 128 KiB; the reader's, whose peer
/// ring did not grow, stays at 64 KiB. With `max_ring_size` at
/// `ring_size` neither grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_stream_grows_its_ring_and_frees_the_one_it_left() {
    const LEN: u64 = 8 << 20;
    for (max, grown, ring) in [(128 * 1024, 1, 128 * 1024), (64 * 1024, 0, 64 * 1024)] {
        let cfg = RdmaConfig::new().max_ring_size(max);
        let l = bind(&cfg).await;
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(RdmaStream::connect_with(addr, &cfg), l.accept());
        let (c, (mut s, _)) = (c.unwrap(), s.unwrap());
        let writer = tokio::spawn(write_pattern(c, 41, LEN));
        assert_eq!(read_pattern(&mut s, 41).await.unwrap(), LEN);
        let c = writer.await.unwrap().unwrap();
        let st = s.stats();
        assert_eq!((st.rings_grown, st.ring_size), (grown, ring), "max {max:?}");
        assert_eq!(st.bytes_received, LEN);
        assert_eq!(st.errors, 0);
        // Without memory windows (siw) the QP is on a PD of its own and
        // keeps its send buffer, and its receive WRs' 4-byte immediate
        // slots when the device has no immediate data.
        let own_pd = st.remote_access == tokio_rdma::RemoteAccess::OwnProtectionDomain;
        let fixed = if own_pd {
            // The default send buffer (64 KiB) and receive WRs (128).
            64 * 1024 + 4 * 128
        } else {
            0
        };
        assert_eq!(
            st.registered_bytes,
            u64::from(ring) + fixed,
            "only the current ring"
        );
        assert_eq!(st.send_buffer_size, 64 * 1024, "max {max:?}");
        let ct = c.stats();
        assert_eq!((ct.rings_grown, ct.ring_size), (0, 64 * 1024));
        assert_eq!(ct.send_buffer_size, ring, "max {max:?}");
        assert_eq!(ct.bytes_sent, LEN);
    }
}

/// After the ring grew, the key of the ring it left opens nothing, even to
/// the peer it was granted to: a write with it fails with a remote access
/// error. And the new ring's key is useless from another connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grown_rings_keys_open_only_the_current_ring_on_its_own_connection() {
    const LEN: u64 = 8 << 20;
    let cfg = RdmaConfig::new().max_ring_size(128 * 1024);
    let l = bind(&cfg).await;
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(RdmaStream::connect_with(addr, &cfg), l.accept());
    let (c, (mut s, _)) = (c.unwrap(), s.unwrap());
    let (c2, s2) = tokio::join!(RdmaStream::connect(addr), l.accept());
    let (mut c2, (_s2, _)) = (c2.unwrap(), s2.unwrap());
    let (first_addr, first_key) = tokio_rdma::__testing::ring_key(&s);
    let (rd, wr) = c.into_split();
    let writer = tokio::spawn(async move {
        let mut sent = 0u64;
        let mut wr = wr;
        while sent < LEN {
            let n = (LEN - sent).min(64 * 1024);
            let buf: Vec<u8> = (0..n).map(|k| pattern(43, sent + k)).collect();
            wr.write_all(&buf).await?;
            sent += n;
        }
        Ok::<_, io::Error>(wr)
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    while got < LEN {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "EOF before all bytes");
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, pattern(43, got + k as u64));
        }
        got += n as u64;
    }
    let wr = writer.await.unwrap().unwrap();
    assert_eq!(s.stats().rings_grown, 1);
    let (new_addr, new_key) = tokio_rdma::__testing::ring_key(&s);
    assert_ne!((new_addr, new_key), (first_addr, first_key));
    // Another connection with the current ring's key: refused.
    assert_forged_write_refused(&mut c2, new_addr, new_key).await;
    // The peer itself, with the first ring's (retired) key: refused too.
    let mut c = rd.reunite(wr).unwrap();
    assert_forged_write_refused(&mut c, first_addr, first_key).await;
}

/// A peer killed while both directions move bulk over grown rings: the
/// blocked reader and writer both get errors (never EOF or a hang), and
/// dropping the stream frees its QP and every memory window, the grown
/// rings' included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_after_growth_wakes_both_sides_and_frees_the_grown_rings() {
    let windows_before = tokio_rdma::stats::resources().memory_windows;
    let before = qp_count();
    let (mut child, mut s) = echo_child(7716, &RdmaConfig::default()).await;
    let data = pattern_buf(51, 64 * 1024);
    // Echo bulk both ways until this side's ring grew.
    let mut echoed = 0u64;
    while s.stats().rings_grown == 0 && echoed < (256 << 20) {
        let (mut rd, mut wr) = s.split();
        let write = async {
            for _ in 0..64 {
                wr.write_all(&data).await?;
            }
            Ok::<_, io::Error>(())
        };
        let read = async {
            let mut back = vec![0u8; 64 * 1024];
            for _ in 0..64 {
                rd.read_exact(&mut back).await?;
                assert!(back == data, "echoed bytes equal");
            }
            Ok::<_, io::Error>(())
        };
        let (w, r) = tokio::join!(write, read);
        w.unwrap();
        r.unwrap();
        echoed += 64 * 64 * 1024;
    }
    let grown = s.stats();
    assert_ne!(
        grown.rings_grown, 0,
        "no growth after {echoed} bytes echoed"
    );
    assert_eq!(
        u64::from(grown.ring_size),
        (64 * 1024) << grown.rings_grown,
        "{grown:?}"
    );
    // Now kill the peer while a writer and a reader are at work.
    let (mut rd, mut wr) = s.split();
    let write = async {
        loop {
            if let Err(e) = wr.write_all(&data).await {
                return e;
            }
        }
    };
    let read = async {
        let mut back = vec![0u8; 64 * 1024];
        loop {
            match rd.read(&mut back).await {
                Ok(0) => panic!("EOF from a killed peer"),
                Ok(_) => {}
                Err(e) => return e,
            }
        }
    };
    let kill = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        child.kill().await.unwrap();
    };
    let (w, r, ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(write, read, kill)
    })
    .await
    .expect("both the writer and the reader are woken");
    for e in [&w, &r] {
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            "{e}"
        );
        assert!(Error::from_io(e).is_some(), "typed: {e:?}");
    }
    drop(s);
    wait_qp_count(before).await;
    assert_eq!(
        tokio_rdma::stats::resources().memory_windows,
        windows_before,
        "every window freed, the grown rings' too"
    );
}

/// Rounds of [`two_processes_connect_to_each_other_at_the_same_moment`].
const MUTUAL_ROUNDS: usize = 40;

/// One side's round of mutual connects: connects to `peer` while
/// accepting one connection on `own`; on the connection it made it writes
/// `[side, round]` and reads the peer's echo of it; on the one it accepted
/// it echoes what arrives. Both in one `join!`, so neither waits on the
/// other's order.
async fn mutual_round(own: &RdmaListener, peer: SocketAddr, side: u8, round: u8) {
    let outgoing = async {
        let mut c = RdmaStream::connect(peer)
            .await
            .expect("connect to the peer");
        c.write_all(&[side, round]).await.expect("write");
        let mut back = [0u8; 2];
        c.read_exact(&mut back).await.expect("read the echo");
        assert_eq!(back, [side, round], "round {round}");
    };
    let incoming = async {
        let (mut s, _) = own.accept().await.expect("accept the peer");
        let mut got = [0u8; 2];
        s.read_exact(&mut got).await.expect("read");
        assert_eq!(got, [1 - side, round], "round {round}");
        s.write_all(&got).await.expect("echo");
        s.flush().await.expect("flush");
        // The peer closes once it read the echo: EOF, nothing more.
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.expect("EOF");
        assert!(rest.is_empty());
    };
    tokio::join!(outgoing, incoming);
}

/// The peer process of the test below (run by it, never on its own: it
/// reads its instructions from stdin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the peer process of two_processes_connect_to_each_other_at_the_same_moment"]
async fn mutual_connect_peer() {
    use tokio::io::AsyncBufReadExt;
    let own = bind(&RdmaConfig::default()).await;
    println!("port {}", own.local_addr().unwrap().port());
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let peer: SocketAddr = lines
        .next_line()
        .await
        .unwrap()
        .expect("the peer's address")
        .parse()
        .unwrap();
    for round in 0..MUTUAL_ROUNDS as u8 {
        assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("go"));
        tokio::time::timeout(Duration::from_secs(30), mutual_round(&own, peer, 1, round))
            .await
            .unwrap_or_else(|_| panic!("peer: round {round} hung"));
        println!("done {round}");
    }
    // The last round's streams close in the background (their FINs are
    // queued behind the echo): exit once they are delivered and every QP
    // of ours is gone, or the other process would read `ConnectionReset`
    // instead of EOF.
    common::background_delivery_done(Duration::from_secs(30)).await;
}

/// Two processes, each with a listener, connect to each other at the same
/// moment (both told to go through a pipe), 40 times: every round both
/// connections come up, each carries its bytes exactly, nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_connect_to_each_other_at_the_same_moment() {
    use tokio::io::AsyncBufReadExt;
    let own = bind(&RdmaConfig::default()).await;
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "mutual_connect_peer", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the peer process");
    let mut to_peer = child.stdin.take().unwrap();
    let mut from_peer = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next_line = async || {
        tokio::time::timeout(Duration::from_secs(60), from_peer.next_line())
            .await
            .expect("a line from the peer in time")
            .unwrap()
    };
    let port = loop {
        let line = next_line().await.expect("the peer's port");
        // libtest may print "test mutual_connect_peer ... " before it.
        if let Some((_, p)) = line.split_once("port ") {
            break p.parse::<u16>().unwrap();
        }
    };
    let peer = SocketAddr::new(IP.parse().unwrap(), port);
    to_peer
        .write_all(format!("{}\n", own.local_addr().unwrap()).as_bytes())
        .await
        .unwrap();
    for round in 0..MUTUAL_ROUNDS as u8 {
        to_peer.write_all(b"go\n").await.unwrap();
        to_peer.flush().await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), mutual_round(&own, peer, 0, round))
            .await
            .unwrap_or_else(|_| panic!("round {round} hung"));
        loop {
            let line = next_line().await.expect("the peer's report");
            if line.ends_with(&format!("done {round}")) {
                break;
            }
        }
    }
    drop(to_peer);
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the peer exits")
        .unwrap();
    assert!(status.success(), "the peer process: {status}");
}
