//! Two hosts on a wire: the same test binary runs in both guests of
//! `integration/softroce pair` (`SOFTROCE_ROLE` a = 10.12.0.1, the
//! server side; b = 10.12.0.2, the client side that asserts), tests in the
//! same order (`--test-threads=1`, alphabetical). Each test's server part
//! ends when its client is done. The peer-crash test comes last (`z_`): it
//! has guest a killed.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it); run
//! outside the pair set-up, every test fails (no role), never skips.
#![cfg(tokio_rdma_guest)]

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::{
    MessageConfig, MessageEndpoint, MessageListener, RdmaConfig, RdmaListener, RdmaStream,
};

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

#[path = "transport_suite/greeter.rs"]
mod greeter;

mod common;
use common::{assert_back_to, echo, open_fds, retry};

/// Attempts (100 ms apart) while the server guest is not listening yet.
const TRIES: u32 = 1200;

const A: &str = "10.12.0.1";

/// The block the crash test's download repeats (64 of them make 64 MiB).
const CRASH_BLOCK: usize = 1 << 20;

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Role {
    Server,
    Client,
}

fn role() -> Role {
    match std::env::var("SOFTROCE_ROLE").as_deref() {
        Ok("a") => Role::Server,
        Ok("b") => Role::Client,
        other => panic!("run by integration/softroce pair (SOFTROCE_ROLE a|b), got {other:?}"),
    }
}

fn at(port: u16) -> SocketAddr {
    format!("{A}:{port}").parse().unwrap()
}

fn pattern_buf(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| shared::pattern_byte(seed, i))
        .collect()
}

/// How long a side waits for its connections' background delivery before
/// returning ([`common::background_delivery_done`]).
const DELIVERY: Duration = Duration::from_secs(120);

/// The config of the tests that move data but measure no failure bound:
/// ack_timeout 16 (retry bound about 1.9 s instead of the default 0.47 s).
/// rxe acknowledges in the guest's kernel, so a guest whose QEMU gets no
/// CPU for half a second (a loaded host) would otherwise exhaust the
/// retries of a healthy connection; a hardware NIC acknowledges by itself.
fn wire() -> RdmaConfig {
    RdmaConfig::new().ack_timeout(16)
}

fn wire_messages() -> MessageConfig {
    MessageConfig::new().connection(wire())
}

/// Connects to the server guest, retrying while it is not listening yet.
async fn connect(port: u16, cfg: &RdmaConfig) -> RdmaStream {
    retry(TRIES, || RdmaStream::connect_with(at(port), cfg)).await
}

/// Writes `len` pattern bytes and half-closes while reading the echo back;
/// returns what came back.
async fn echo_client(s: RdmaStream, seed: u64, len: usize) -> Vec<u8> {
    let (mut rd, mut wr) = s.into_split();
    let data = pattern_buf(seed, len);
    let expect = data.clone();
    let writer = tokio::spawn(async move {
        for chunk in data.chunks(64 * 1024) {
            wr.write_all(chunk).await.unwrap();
        }
        wr.shutdown().await.unwrap();
    });
    let mut back = Vec::with_capacity(len);
    rd.read_to_end(&mut back).await.unwrap();
    writer.await.unwrap();
    assert_eq!(back.len(), expect.len());
    assert!(back == expect, "echo of {len} bytes across the wire");
    back
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_echo_across_the_wire() {
    const PORT: u16 = 7801;
    let sizes = [1usize, 4097, 1 << 20, 64 << 20];
    match role() {
        Role::Server => {
            let l = RdmaListener::bind_with(at(PORT), &wire()).await.unwrap();
            for &len in &sizes {
                let (s, _) = l.accept().await.unwrap();
                assert_eq!(echo(s).await.unwrap(), len as u64);
            }
            // 64 concurrent connections.
            let mut tasks = Vec::new();
            for _ in 0..64 {
                let (s, _) = l.accept().await.unwrap();
                tasks.push(tokio::spawn(echo(s)));
            }
            for t in tasks {
                assert_eq!(t.await.unwrap().unwrap(), 65536);
            }
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            let cfg = wire();
            for (i, &len) in sizes.iter().enumerate() {
                echo_client(connect(PORT, &cfg).await, i as u64, len).await;
            }
            let mut tasks = Vec::new();
            for c in 0..64u64 {
                let s = connect(PORT, &cfg).await;
                tasks.push(tokio::spawn(echo_client(s, 100 + c, 65536)));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_messages_across_the_wire() {
    const PORT: u16 = 7802;
    let sizes = [0usize, 64, 4096, 4097, 64 << 20];
    match role() {
        Role::Server => {
            let l = MessageListener::bind_with(at(PORT), &wire_messages())
                .await
                .unwrap();
            let (ep, _) = l.accept().await.unwrap();
            while let Some(m) = ep.recv().await.unwrap() {
                ep.send(m).await.unwrap();
            }
            ep.close().await.unwrap();
        }
        Role::Client => {
            let cfg = wire_messages();
            let ep = retry(TRIES, || MessageEndpoint::connect_with(at(PORT), &cfg)).await;
            for (i, &len) in sizes.iter().enumerate() {
                let data = pattern_buf(i as u64, len);
                ep.send_copy(&data).await.unwrap();
                let back = ep.recv().await.unwrap().expect("the echo");
                assert_eq!(back.len(), len);
                assert_eq!(
                    crc32fast::hash(&back),
                    crc32fast::hash(&data),
                    "message of {len} bytes"
                );
            }
            ep.close().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_auto_falls_back_to_a_tcp_only_server() {
    const PORT: u16 = 7803;
    match role() {
        Role::Server => {
            // Over iWARP the client's RDMA attempt is itself a TCP
            // connection: this listener takes it, and it sends MPA's
            // request (`MPA ID Req Frame`) before it gives up; the
            // fallback comes next.
            let l = tokio::net::TcpListener::bind(at(PORT)).await.unwrap();
            // The client dials once this listener is up: a first RDMA
            // attempt refused before the bind, and a fallback that came
            // after it, would make no MPA connection on iWARP.
            set_flag("c-listening");
            let mut not_ours = 0;
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 5];
                s.read_exact(&mut buf).await.unwrap();
                if &buf == b"hello" {
                    s.write_all(&buf).await.unwrap();
                    break;
                }
                assert_eq!(&buf, b"MPA I", "only MPA's request comes first");
                not_ours += 1;
            }
            assert_eq!(not_ours, usize::from(common::iwarp()));
        }
        Role::Client => {
            wait_flag("c-listening").await;
            let addr = format!("auto://{A}:{PORT}");
            let mut s = retry(TRIES, || {
                tokio_rdma::transport::Stream::connect(addr.as_str())
            })
            .await;
            assert_eq!(s.transport(), tokio_rdma::transport::Transport::Tcp);
            s.write_all(b"hello").await.unwrap();
            let mut back = [0u8; 5];
            s.read_exact(&mut back).await.unwrap();
            assert_eq!(&back, b"hello");
        }
    }
}

/// A command (`DEV`: the wire NIC, `SOFTROCE_NIC`) run when dropped, its
/// failure ignored: it puts back what a test changed on the wire (a netem
/// qdisc, the MTU, the link state), so a test that fails midway leaves the
/// wire working for the tests after it.
struct RestoreNic(&'static [&'static str]);

impl RestoreNic {
    /// Removes the netem qdisc.
    fn netem() -> Self {
        RestoreNic(&["tc", "qdisc", "del", "dev", "DEV", "root"])
    }

    /// The MTU back to 1500, what integration/softroce sets up.
    fn mtu() -> Self {
        RestoreNic(&["ip", "link", "set", "dev", "DEV", "mtu", "1500"])
    }

    /// The link up.
    fn link_up() -> Self {
        RestoreNic(&["ip", "link", "set", "dev", "DEV", "up"])
    }
}

impl Drop for RestoreNic {
    fn drop(&mut self) {
        if let Ok(nic) = std::env::var("SOFTROCE_NIC") {
            let _ = std::process::Command::new(self.0[0])
                .args(self.0[1..].iter().map(|a| a.replace("DEV", &nic)))
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Runs `ip link set dev NIC ARGS` on the wire NIC and asserts it worked.
fn ip_link_set(args: &[&str]) {
    let nic = std::env::var("SOFTROCE_NIC").expect("SOFTROCE_NIC");
    let st = std::process::Command::new("ip")
        .args(["link", "set", "dev", &nic])
        .args(args)
        .status()
        .unwrap();
    assert!(st.success(), "ip link set dev {nic} {args:?}");
}

/// Runs `tc qdisc ARGS` (DEV is the wire NIC); `replace` installs netem
/// whether or not a qdisc is there.
fn netem(args: &str) {
    let nic = std::env::var("SOFTROCE_NIC").expect("SOFTROCE_NIC");
    let cmd = format!("tc qdisc {args}");
    let st = std::process::Command::new("sh")
        .args(["-c", &cmd.replace("DEV", &nic)])
        .status()
        .unwrap();
    assert!(st.success(), "{cmd}");
}

/// 1 % loss and 5 ms delay on the client's NIC: a 64 MiB echo and a 64 MiB
/// message arrive intact (rxe retransmits; perftest's ACK timeout keeps
/// each loss cheap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_loss_and_delay_lose_nothing() {
    const PORT: u16 = 7804;
    match role() {
        Role::Server => {
            let l = RdmaListener::bind(at(PORT)).await.unwrap();
            let (s, _) = l.accept().await.unwrap();
            assert_eq!(echo(s).await.unwrap(), 64 << 20);
            let ml = MessageListener::bind(at(PORT + 1)).await.unwrap();
            let (ep, _) = ml.accept().await.unwrap();
            while let Some(m) = ep.recv().await.unwrap() {
                ep.send(m).await.unwrap();
            }
            drop(ep);
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            let _netem = RestoreNic::netem();
            netem("replace dev DEV root netem loss 1% delay 5ms");
            echo_client(connect(PORT, &RdmaConfig::default()).await, 7, 64 << 20).await;
            let ep = retry(TRIES, || MessageEndpoint::connect(at(PORT + 1))).await;
            let data = pattern_buf(8, 64 << 20);
            ep.send_copy(&data).await.unwrap();
            let back = ep.recv().await.unwrap().expect("the echo");
            assert_eq!(crc32fast::hash(&back), crc32fast::hash(&data));
            ep.close().await.unwrap();
            netem("del dev DEV root");
        }
    }
}

/// A partition shorter than the retry bound heals without the application
/// noticing: 100 % loss on the client's NIC for 200 ms in the middle of a
/// 16 MiB echo, which completes byte for byte. (The partition is netem's
/// total loss: the link stays up, as on a switch that drops everything.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_a_short_partition_heals() {
    const PORT: u16 = 7805;
    // A retry bound of about 1.9 s (ack_timeout 16, 6 retries) on both
    // sides: well above the 200 ms partition plus the time to start `tc`
    // twice, even when the emulated hosts are slowed down by other work on
    // the machine.
    let cfg = RdmaConfig::new().ack_timeout(16);
    assert!(cfg.retry_bound() > Duration::from_millis(1800));
    match role() {
        Role::Server => {
            let l = RdmaListener::bind_with(at(PORT), &cfg).await.unwrap();
            let (s, _) = l.accept().await.unwrap();
            assert_eq!(echo(s).await.unwrap(), 16 << 20);
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            let s = connect(PORT, &cfg).await;
            let _netem = RestoreNic::netem();
            netem("replace dev DEV root netem loss 0%");
            let echo = tokio::spawn(echo_client(s, 10, 16 << 20));
            tokio::time::sleep(Duration::from_millis(500)).await;
            netem("change dev DEV root netem loss 100%");
            tokio::time::sleep(Duration::from_millis(200)).await;
            netem("change dev DEV root netem loss 0%");
            tokio::time::timeout(Duration::from_secs(120), echo)
                .await
                .expect("the echo completes after the partition")
                .unwrap();
            netem("del dev DEV root");
        }
    }
}

/// A partition longer than the retry bound fails the connection cleanly on
/// both sides: the client's writer (traffic in flight) within the retry
/// bound, the server's idle reader by its keepalive probe (1 s); each gets
/// `ConnectionReset`, never EOF and never a hang. On iWARP, whose
/// retransmission is TCP's (minutes), an unanswered probe fails the
/// connection after a keepalive period: `TimedOut`
/// (`Error::KeepaliveTimeout`), as TCP's keepalive gives `ETIMEDOUT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f_a_long_partition_fails_both_sides() {
    const PORT: u16 = 7806;
    let cfg = RdmaConfig::new().keepalive(Some(Duration::from_secs(1)));
    let ceiling = (Duration::from_secs(1) + cfg.retry_bound()) * 3 + Duration::from_secs(10);
    match role() {
        Role::Server => {
            let l = RdmaListener::bind_with(at(PORT), &cfg).await.unwrap();
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let err = tokio::time::timeout(ceiling + Duration::from_secs(30), async {
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) => panic!("EOF instead of an error"),
                        Ok(_) => {}
                        Err(e) => break e,
                    }
                }
            })
            .await
            .expect("the server side notices the partition");
            if common::iwarp() {
                assert!(
                    matches!(
                        tokio_rdma::Error::from_io(&err),
                        Some(tokio_rdma::Error::KeepaliveTimeout { .. })
                    ),
                    "{err:?}"
                );
            } else {
                assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
            }
        }
        Role::Client => {
            let mut s = connect(PORT, &cfg).await;
            let _netem = RestoreNic::netem();
            netem("replace dev DEV root netem loss 0%");
            let chunk = pattern_buf(11, 64 * 1024);
            for _ in 0..16 {
                s.write_all(&chunk).await.unwrap();
            }
            netem("change dev DEV root netem loss 100%");
            let err = tokio::time::timeout(ceiling, async {
                loop {
                    if let Err(e) = s.write_all(&chunk).await {
                        break e;
                    }
                }
            })
            .await
            .expect("the writer fails within the bound");
            assert!(
                matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                ) || (common::iwarp() && err.kind() == io::ErrorKind::TimedOut),
                "{err}"
            );
            // Keep the wire cut until the server's keepalive has had time to
            // fail too, then heal it for the tests after this one.
            tokio::time::sleep(
                Duration::from_secs(1) + cfg.retry_bound() * 2 + Duration::from_secs(2),
            )
            .await;
            netem("del dev DEV root");
        }
    }
}

/// Waits (up to 5 minutes) for the other guest to drop `name` in the
/// shared control folder.
async fn wait_flag(name: &str) {
    let ctl = std::path::PathBuf::from(std::env::var("SOFTROCE_CTL").unwrap());
    for _ in 0..3000 {
        if ctl.join(name).exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the other guest never set {name}");
}

fn set_flag(name: &str) {
    let ctl = std::path::PathBuf::from(std::env::var("SOFTROCE_CTL").unwrap());
    std::fs::write(ctl.join(name), b"").unwrap();
}

/// hyper's HTTP/1.1 server on a transport `Listener` (`rdma://`) in guest
/// a, hyper_util's pooled client with the crate's `Connector` in guest b:
/// 50 POST echoes of 0..64 KiB, bytes equal, over RDMA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g_hyper_across_the_wire() {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use tokio_rdma::transport::{Connector, Listener, Transport};
    const PORT: u16 = 7807;
    match role() {
        Role::Server => {
            let l = Listener::bind(format!("rdma://{A}:{PORT}")).await.unwrap();
            // hyper_util's HTTP/1.1 pool may open more than one connection:
            // serve each until the client says it is done.
            let done = wait_flag("hyper-done");
            tokio::pin!(done);
            loop {
                tokio::select! {
                    r = l.accept() => {
                        let (stream, _) = r.unwrap();
                        assert_eq!(stream.transport(), Transport::Rdma);
                        let svc = hyper::service::service_fn(
                            |req: hyper::Request<hyper::body::Incoming>| async move {
                                let body = req.into_body().collect().await?.to_bytes();
                                Ok::<_, hyper::Error>(hyper::Response::new(Full::new(body)))
                            },
                        );
                        tokio::spawn(
                            hyper::server::conn::http1::Builder::new()
                                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
                        );
                    }
                    _ = &mut done => break,
                }
            }
        }
        Role::Client => {
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build::<_, Full<Bytes>>(Connector::new(Transport::Rdma));
            let uri: hyper::Uri = format!("http://{A}:{PORT}/echo").parse().unwrap();
            for i in 0..50usize {
                let body = Bytes::from(pattern_buf(i as u64, (i * 1311) % 65536));
                let deadline = Instant::now() + Duration::from_secs(120);
                let resp = loop {
                    let req = hyper::Request::post(uri.clone())
                        .body(Full::new(body.clone()))
                        .unwrap();
                    match client.request(req).await {
                        Ok(r) => break r,
                        Err(e) if i == 0 && Instant::now() < deadline => {
                            let _ = e;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => panic!("request {i}: {e}"),
                    }
                };
                assert_eq!(resp.status(), 200);
                let got = resp.into_body().collect().await.unwrap().to_bytes();
                assert!(got == body, "echo {i}");
            }
            set_flag("hyper-done");
        }
    }
}

/// tonic's server on `Listener::into_incoming` in guest a, a channel
/// through `transport::channel` in guest b: unary, server streaming and
/// bidirectional streaming across the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h_tonic_across_the_wire() {
    use futures::StreamExt;
    use tokio_rdma::transport::{Listener, TransportAddr};
    const PORT: u16 = 7808;
    match role() {
        Role::Server => {
            let l = Listener::bind(format!("rdma://{A}:{PORT}")).await.unwrap();
            tonic::transport::Server::builder()
                .add_service(greeter::GreeterServer)
                .serve_with_incoming_shutdown(l.into_incoming(), wait_flag("tonic-done"))
                .await
                .unwrap();
        }
        Role::Client => {
            let addr: TransportAddr = format!("rdma://{A}:{PORT}").parse().unwrap();
            let cfg = RdmaConfig::default();
            let channel = retry(TRIES, || tokio_rdma::transport::channel_with(&addr, &cfg)).await;
            let mut client = greeter::GreeterClient::new(channel);
            let hello = client.say_hello("wire").await.unwrap();
            assert!(
                hello.starts_with("Hello, wire over rdma from 10.12.0.2"),
                "{hello}"
            );
            let counted: Vec<_> = client
                .count(20)
                .await
                .unwrap()
                .map(|m| m.unwrap())
                .collect()
                .await;
            assert_eq!(counted.len(), 20);
            let sent: Vec<bytes::Bytes> = (0..20u64)
                .map(|i| bytes::Bytes::from(pattern_buf(i, (i as usize * 3001) % 60000)))
                .collect();
            let echoed: Vec<bytes::Bytes> = client
                .echo(futures::stream::iter(sent.clone()))
                .await
                .unwrap()
                .map(|m| m.unwrap())
                .collect()
                .await;
            assert_eq!(echoed, sent);
            set_flag("tonic-done");
        }
    }
}

/// Connecting to an address no host answers (10.12.0.99: no ARP reply) is a
/// typed error within the connect timeout, naming the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i_a_host_that_does_not_exist_is_a_typed_error() {
    if role() == Role::Server {
        return;
    }
    let cfg = RdmaConfig::new().connect_timeout(Duration::from_secs(20));
    let err = RdmaStream::connect_with("10.12.0.99:7809", &cfg)
        .await
        .unwrap_err();
    assert!(
        matches!(
            tokio_rdma::Error::from_io(&err),
            Some(tokio_rdma::Error::Unreachable { .. } | tokio_rdma::Error::TimedOut { .. })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("10.12.0.99"), "{err}");
}

/// Connecting while the wire is cut (netem 100 % loss on b's egress): the
/// connect request (CM REQ) is never answered, so the connect fails with
/// `Error::TimedOut` at `ConnectStage::AwaitingReply` within the connect
/// timeout (3 s here; asserted against a liveness ceiling), naming the
/// address and leaving no verbs objects or fds behind; once the wire heals,
/// the same listener accepts and echoes. (On iWARP the connect is TCP's,
/// inside rdma_connect: it ends after TCP's SYN retries, about 130 s, or
/// earlier with `HostUnreachable` once ARP gave up on the peer; one reset
/// connection is allowed there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_a_connect_across_a_partition_times_out() {
    const PORT: u16 = 7810;
    match role() {
        Role::Server => {
            let l = RdmaListener::bind(at(PORT)).await.unwrap();
            set_flag("j-listening");
            // On iWARP the connect that timed out is a TCP connect the
            // kernel goes on with (it cannot be cancelled from user space)
            // until it succeeds once the wire heals, and is then closed at
            // once: this listener may take that connection first, and it
            // resets.
            let mut reset = 0;
            loop {
                let (s, _) = l.accept().await.unwrap();
                match echo(s).await {
                    Ok(n) => {
                        assert_eq!(n, 4097);
                        break;
                    }
                    Err(e) if common::iwarp() && reset == 0 => {
                        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
                        reset += 1;
                    }
                    Err(e) => panic!("the echo after the partition: {e:?}"),
                }
            }
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            wait_flag("j-listening").await;
            common::background_delivery_done(DELIVERY).await;
            let (start, fds) = (tokio_rdma::stats::resources(), open_fds());
            let timeout = Duration::from_secs(3);
            let cfg = RdmaConfig::new().connect_timeout(timeout);
            let (err, took) = {
                let _netem = RestoreNic::netem();
                netem("replace dev DEV root netem loss 100%");
                let t = Instant::now();
                let err = RdmaStream::connect_with(at(PORT), &cfg)
                    .await
                    .expect_err("nothing answers across a cut wire");
                (err, t.elapsed())
            };
            // iWARP's TCP connect inside rdma_connect may also end when the
            // neighbour entry of the peer expired while its SYNs went
            // unanswered: EHOSTUNREACH, as TCP's connect would.
            match tokio_rdma::Error::from_io(&err) {
                Some(tokio_rdma::Error::TimedOut {
                    stage: tokio_rdma::error::ConnectStage::AwaitingReply,
                    ..
                }) => assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}"),
                Some(tokio_rdma::Error::Unreachable { .. }) if common::iwarp() => {
                    assert_eq!(err.kind(), io::ErrorKind::HostUnreachable, "{err}")
                }
                _ => panic!("{err:?}"),
            }
            assert!(err.to_string().contains("10.12.0.1:7810"), "{err}");
            // iWARP connects its TCP connection inside rdma_connect, which
            // the connect timeout cannot cut short: TCP's SYN retries
            // (tcp_syn_retries 6: about 130 s) bound it there.
            let ceiling = if common::iwarp() {
                Duration::from_secs(200)
            } else {
                timeout * 3 + Duration::from_secs(5)
            };
            assert!(
                took < ceiling,
                "the connect gave up after {took:?} (timeout {timeout:?})"
            );
            assert_back_to(start, fds, 2, Duration::from_secs(60)).await;
            let s = connect(PORT, &RdmaConfig::new()).await;
            echo_client(s, 13, 4097).await;
        }
    }
}

/// Rendezvous both ways under 1 % loss and 5 ms delay: 125 messages of
/// 64 KiB echoed with 8 in flight (the receiver of each RDMA READs it). On
/// rxe (Debian 12's kernel) the retry of a READ whose response lost a
/// packet can wedge the requester: no completion, no error, the QP stays in
/// RTS. Either every echo comes back equal (CRC-32), or both sides fail with
/// a typed error within the keepalive bound (keepalive 2 s here: a probe
/// still outstanding one idle period later is `KeepaliveTimeout`,
/// `TimedOut`; the peer then sees `ConnectionReset`), never a hang and
/// never different bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_rendezvous_echo_under_loss_completes_or_fails_typed() {
    const PORT: u16 = 7811;
    const COUNT: u64 = 125;
    const LEN: usize = 64 * 1024;
    let keepalive = Duration::from_secs(2);
    let rdma = RdmaConfig::new().keepalive(Some(keepalive));
    let cfg = MessageConfig::new().connection(rdma.clone());
    // Liveness ceiling: the transfer itself, then two idle periods, the
    // retry bound and the ABORT grace, with TCG's slack.
    let ceiling = Duration::from_secs(120) + (keepalive * 2 + rdma.retry_bound()) * 3;
    let typed = |e: &io::Error| {
        matches!(
            e.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::ConnectionReset
        ) && tokio_rdma::Error::from_io(e).is_some()
    };
    match role() {
        Role::Server => {
            let l = MessageListener::bind_with(at(PORT), &cfg).await.unwrap();
            let (ep, _) = l.accept().await.unwrap();
            let served = tokio::time::timeout(ceiling, async {
                let mut n = 0u64;
                loop {
                    match ep.recv().await {
                        Ok(Some(m)) => {
                            ep.send(m).await?;
                            n += 1;
                        }
                        Ok(None) => return Ok(n),
                        Err(e) => return Err(e),
                    }
                }
            })
            .await
            .expect("the server side ends: the client's close or a typed error");
            match served {
                Ok(n) => {
                    assert_eq!(n, COUNT);
                    ep.close().await.unwrap();
                }
                Err(e) => {
                    assert!(typed(&e), "{e:?}");
                    eprintln!("server: {e}");
                    // The failed endpoint frees its QP once its last handle
                    // is gone.
                    drop(ep);
                }
            }
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            let ep = retry(TRIES, || MessageEndpoint::connect_with(at(PORT), &cfg)).await;
            let _netem = RestoreNic::netem();
            netem("replace dev DEV root netem loss 1% delay 5ms");
            let outcome = tokio::time::timeout(ceiling, async {
                let mut sent = std::collections::VecDeque::new();
                let (mut posted, mut back) = (0u64, 0u64);
                while back < COUNT {
                    while posted < COUNT && sent.len() < 8 {
                        let data = pattern_buf(100 + posted, LEN);
                        sent.push_back(crc32fast::hash(&data));
                        ep.send_copy(&data).await?;
                        posted += 1;
                    }
                    let m = ep.recv().await?.expect("an echo, not a close");
                    assert_eq!(m.len(), LEN);
                    assert_eq!(
                        crc32fast::hash(&m),
                        sent.pop_front().unwrap(),
                        "echo {back}"
                    );
                    back += 1;
                }
                ep.close().await?;
                Ok::<_, io::Error>(back)
            })
            .await
            .expect("the echo ends: every message back or a typed error");
            match outcome {
                Ok(n) => {
                    assert_eq!(n, COUNT);
                    eprintln!("rendezvous echo under loss: all {n} echoes equal");
                }
                Err(e) => {
                    assert!(typed(&e), "{e:?}");
                    eprintln!("rendezvous echo under loss: {e}");
                }
            }
        }
    }
}

/// The server host crashes while one connection is idle and two are in the
/// middle of 64 MiB transfers, one each way: on the idle one keepalive (2 s
/// here) probes, the RC retries run out, and the blocked read returns
/// `ConnectionReset` within keepalive + retry bound (asserted against 3x
/// that, a liveness ceiling), never EOF; the writer of one busy connection
/// and the reader of the other fail too (every byte read before the crash
/// equal to what was sent), never a silent success or EOF; then this
/// side's verbs objects and fds are back where they were.
/// One way, 32 rendezvous messages of 1 MiB, then `flush`: the receiver's
/// 32 DONEs make the sender return CREDITs (every quarter of its posted
/// receive buffers), and the last can be the sender's last work request
/// outstanding; its completion must wake the flush. (It did not, and across
/// this wire, where the CREDIT's acknowledgement comes 44 ms later, the
/// flush waited until an unrelated event: 120 s in the run that showed
/// it.) The bound is a liveness ceiling: the transfer takes about 2.5 s
/// here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l_a_one_way_rendezvous_burst_flushes() {
    const PORT: u16 = 7812;
    const COUNT: u64 = 32;
    const LEN: usize = 1 << 20;
    match role() {
        Role::Server => {
            let l = MessageListener::bind_with(at(PORT), &wire_messages())
                .await
                .unwrap();
            let (ep, _) = l.accept().await.unwrap();
            let mut n = 0u64;
            while let Some(m) = ep.recv().await.unwrap() {
                assert_eq!(m.len(), LEN);
                assert_eq!(
                    crc32fast::hash(&m),
                    crc32fast::hash(&pattern_buf(700 + n, LEN)),
                    "message {n}"
                );
                n += 1;
            }
            assert_eq!(n, COUNT);
            assert_eq!(ep.stats().rendezvous_received, COUNT);
        }
        Role::Client => {
            let cfg = wire_messages();
            let ep = retry(TRIES, || MessageEndpoint::connect_with(at(PORT), &cfg)).await;
            for n in 0..COUNT {
                ep.send_copy(&pattern_buf(700 + n, LEN)).await.unwrap();
            }
            tokio::time::timeout(Duration::from_secs(40), ep.flush())
                .await
                .expect("flush of 32 one-way rendezvous messages never returned")
                .unwrap();
            let st = ep.stats();
            assert_eq!(st.rendezvous_sent, COUNT);
            // 32 DONEs came back (control messages that take receive
            // slots), so CREDITs went out; how many depends on how the
            // DONEs arrived together.
            assert!(st.control_received >= COUNT, "{st:?}");
            assert!(st.credits_sent > 0, "{st:?}");
            ep.close().await.unwrap();
        }
    }
}

/// Remote memory across the wire: guest a grants a 4 MiB region (READ,
/// WRITE, and ATOMIC where the device has atomics) and sends its
/// `RemoteRegion` as a message; guest b reads it at unaligned offsets
/// (bytes equal), writes and reads back, posts a batch of 16 with one
/// doorbell, adds 1,000 times to a counter with fetch-and-add from 4
/// tasks (not on iWARP: no atomics), and writes 64 blocks with
/// `write_notify`. Guest a checks every notification against the bytes
/// in place and the counter's exact sum, then revokes the grant; b's
/// next READ through it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m_remote_memory_across_the_wire() {
    use tokio_rdma::Incoming;
    use tokio_rdma::remote::{GrantAccess, LocalRegion, RemoteRegion, Transfer};
    const PORT: u16 = 7813;
    const LEN: usize = 4 << 20;
    const NOTIFIES: usize = 64;
    const BLOCK: usize = 8192;
    const INBOX: usize = 2 << 20;
    const ADDS: u64 = 1000;
    let atomics = !common::iwarp();
    match role() {
        Role::Server => {
            let l = MessageListener::bind_with(at(PORT), &wire_messages())
                .await
                .unwrap();
            let (ep, _) = l.accept().await.unwrap();
            let reg = LocalRegion::new(ep.pool().alloc_any(LEN).await.unwrap());
            reg.write_at(0, &pattern_buf(900, LEN)).unwrap();
            // The counter: the region's first 8 bytes, zeroed.
            reg.write_at(0, &[0u8; 8]).unwrap();
            let mut access = GrantAccess::READ | GrantAccess::WRITE;
            if atomics {
                access = access | GrantAccess::ATOMIC;
            }
            let grant = ep.grant(&reg, 0..LEN, access).await.unwrap();
            ep.send_copy(&grant.remote().encode()).await.unwrap();
            for i in 0..NOTIFIES {
                match ep.recv_incoming().await.unwrap() {
                    Some(Incoming::Notification(n)) => {
                        assert_eq!(n.value, i as u32);
                        assert_eq!(n.len as usize, BLOCK + i);
                        let mut landed = vec![0u8; BLOCK + i];
                        reg.read_at(INBOX + i * 2 * BLOCK, &mut landed).unwrap();
                        assert!(
                            landed == pattern_buf(1000 + i as u64, BLOCK + i),
                            "block {i}"
                        );
                    }
                    other => panic!("notification {i}: {other:?}"),
                }
            }
            let want = if atomics { 4 * ADDS } else { 0 };
            assert_eq!(reg.load_u64(0).unwrap(), want, "the counter");
            grant.revoke().await.unwrap();
            ep.send_copy(b"revoked").await.unwrap();
            // b's refused READ fails the connection: this side sees the
            // end (or, on iWARP, the TERMINATE).
            let end = tokio::time::timeout(Duration::from_secs(30), ep.recv()).await;
            assert!(end.is_ok(), "the connection ends after the refused READ");
        }
        Role::Client => {
            let cfg = wire_messages();
            let ep = retry(TRIES, || MessageEndpoint::connect_with(at(PORT), &cfg)).await;
            let m = ep.recv().await.unwrap().expect("the grant");
            let remote = RemoteRegion::decode(&m).unwrap();
            assert_eq!(remote.len(), LEN as u64);
            let whole = pattern_buf(900, LEN);
            for (offset, len) in [(8usize, 1usize), (13, 4099), (65_541, 1 << 20)] {
                let got = ep.read(&remote, offset as u64, len).await.unwrap();
                assert!(
                    got[..] == whole[offset..offset + len],
                    "READ of {len} at {offset}"
                );
            }
            let data = pattern_buf(901, 100_003);
            ep.write(&remote, 3 << 20, &data).await.unwrap();
            let back = ep.read(&remote, 3 << 20, data.len()).await.unwrap();
            assert!(back[..] == data[..], "a WRITE read back");
            let ops: Vec<Transfer<'_>> = (0..16u64)
                .map(|k| Transfer::Read {
                    remote: &remote,
                    offset: 8 + k * 4099,
                    len: 4099,
                })
                .collect();
            let got = ep.transfer(&ops).await.unwrap();
            for (k, b) in got.iter().enumerate() {
                let at = 8 + k * 4099;
                assert!(b[..] == whole[at..at + 4099], "batched READ {k}");
            }
            if atomics {
                let ep = &ep;
                let remote = &remote;
                let adders = (0..4).map(|_| async move {
                    for _ in 0..ADDS {
                        ep.fetch_add(remote, 0, 1).await.unwrap();
                    }
                });
                futures::future::join_all(adders).await;
            }
            for i in 0..NOTIFIES {
                let block = pattern_buf(1000 + i as u64, BLOCK + i);
                let offset = (INBOX + i * 2 * BLOCK) as u64;
                ep.write_notify(&remote, offset, &block, i as u32)
                    .await
                    .unwrap();
            }
            ep.flush().await.unwrap();
            let m = ep.recv().await.unwrap().expect("the revocation");
            assert_eq!(&m[..], b"revoked");
            let e = ep.read(&remote, 8, 8).await.unwrap_err();
            assert_ne!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
            if !common::iwarp() {
                assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            }
        }
    }
}

/// Sets this guest's wire NIC to `mtu` bytes and waits (up to 10 s) until
/// its RDMA port's active MTU follows (rxe sets it at the netdev's MTU
/// change: the netdev MTU less rxe's 80 bytes of headers, rounded down to
/// an IB MTU). Returns the port's active MTU in bytes (0 on iWARP, whose
/// port MTU means nothing to a connection).
async fn set_mtu(mtu: u32) -> u32 {
    ip_link_set(&["mtu", &mtu.to_string()]);
    let want = port_mtu(mtu);
    if want == 0 {
        return 0;
    }
    for _ in 0..500 {
        let now = tokio_rdma::verbs::devices()
            .unwrap()
            .iter()
            .filter(|d| d.name == common::device())
            .flat_map(|d| &d.ports)
            .map(|p| p.active_mtu)
            .next();
        if now == Some(want) {
            return want;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the port's active MTU is not {want} 10 s after netdev MTU {mtu}");
}

/// The active MTU of a Soft-RoCE port on a netdev of `mtu` bytes: the
/// netdev MTU less rxe's 80 bytes of headers (`RXE_MAX_HDR_LENGTH`),
/// rounded down to an IB MTU. 0 on iWARP (no path MTU).
fn port_mtu(mtu: u32) -> u32 {
    if common::iwarp() {
        return 0;
    }
    match mtu - 80 {
        m if m >= 4096 => 4096,
        m if m >= 2048 => 2048,
        m if m >= 1024 => 1024,
        m => panic!("no test uses a netdev MTU of {m} + 80"),
    }
}

/// Two hosts whose netdevs have different MTUs (a/b: 1500/9000, 9000/1500,
/// 4200/1500): both ends of every connection use the same path MTU, the
/// smaller port's (1024 bytes for a 1500-byte netdev on RoCE; 0 on
/// iWARP, which has none), and a 4 MiB stream echo, messages of 1 B to
/// 8 MiB (eager and rendezvous) and a 1 MiB one-sided READ arrive byte for
/// byte in both directions. rdma_cm alone gives the passive side the
/// active side's MTU: with the active side at 9000 the passive host's
/// 1500-byte netdev cannot carry its 4096-byte packets. Built with the
/// agreement left out, case 0's stream echo stalled until the accepting
/// side's keepalive failed it after 30 s (`KeepaliveTimeout`; the
/// connecting side saw `PeerDisconnected`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_hosts_with_different_mtus_agree_on_the_path_mtu() {
    use tokio_rdma::remote::{GrantAccess, LocalRegion, RemoteRegion};
    const PORT: u16 = 7820;
    const CASES: [(u32, u32); 3] = [(1500, 9000), (9000, 1500), (4200, 1500)];
    const SIZES: [usize; 6] = [1, 1000, 4097, 65_536, 1 << 20, 8 << 20];
    let _mtu = RestoreNic::mtu();
    for (i, (mtu_a, mtu_b)) in CASES.into_iter().enumerate() {
        let port = PORT + 3 * i as u16;
        match role() {
            Role::Server => {
                assert_eq!(set_mtu(mtu_a).await, port_mtu(mtu_a));
                let l = RdmaListener::bind_with(at(port), &wire()).await.unwrap();
                let (s, _) = l.accept().await.unwrap();
                let agreed = s.path_mtu();
                assert_eq!(echo(s).await.unwrap(), 4 << 20);
                let ml = MessageListener::bind_with(at(port + 1), &wire_messages())
                    .await
                    .unwrap();
                let (ep, _) = ml.accept().await.unwrap();
                assert_eq!(ep.path_mtu(), agreed, "case {i}");
                // A region the client reads with one-sided READs.
                let reg = LocalRegion::new(ep.pool().alloc_any(1 << 20).await.unwrap());
                reg.write_at(0, &pattern_buf(40 + i as u64, 1 << 20))
                    .unwrap();
                let grant = ep.grant(&reg, 0..1 << 20, GrantAccess::READ).await.unwrap();
                ep.send_copy(&grant.remote().encode()).await.unwrap();
                while let Some(m) = ep.recv().await.unwrap() {
                    ep.send(m).await.unwrap();
                }
                drop(grant);
                drop(ep);
                common::background_delivery_done(DELIVERY).await;
                let expect = port_mtu(mtu_a).min(port_mtu(mtu_b));
                assert_eq!(agreed, expect, "case {i}: MTU a {mtu_a}, b {mtu_b}");
            }
            Role::Client => {
                assert_eq!(set_mtu(mtu_b).await, port_mtu(mtu_b));
                let s = connect(port, &wire()).await;
                let agreed = s.path_mtu();
                echo_client(s, 30 + i as u64, 4 << 20).await;
                let cfg = wire_messages();
                let ep = retry(TRIES, || MessageEndpoint::connect_with(at(port + 1), &cfg)).await;
                assert_eq!(ep.path_mtu(), agreed, "case {i}");
                let m = ep.recv().await.unwrap().expect("the grant");
                let remote = RemoteRegion::decode(&m).unwrap();
                let got = ep.read(&remote, 0, 1 << 20).await.unwrap();
                assert!(
                    got[..] == pattern_buf(40 + i as u64, 1 << 20)[..],
                    "case {i}: the READ"
                );
                for (k, len) in SIZES.into_iter().enumerate() {
                    let data = pattern_buf(50 + k as u64, len);
                    ep.send_copy(&data).await.unwrap();
                    let back = ep.recv().await.unwrap().expect("the echo");
                    assert_eq!(back.len(), len, "case {i}");
                    assert!(back[..] == data[..], "case {i}: {len} B message");
                }
                ep.close().await.unwrap();
                common::background_delivery_done(DELIVERY).await;
                let expect = port_mtu(mtu_a).min(port_mtu(mtu_b));
                assert_eq!(agreed, expect, "case {i}: MTU a {mtu_a}, b {mtu_b}");
            }
        }
    }
}

/// Waits (at most 30 s) until this process holds no rdma_cm id: a closed
/// connection's id is destroyed off the runtime after its QP, so it can
/// outlive [`common::background_delivery_done`]. `what` names the ids in
/// the failure.
async fn cm_ids_destroyed(what: &str) {
    let t = Instant::now();
    while tokio_rdma::stats::resources().cm_ids > 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sets this guest's wire NIC down for `down`, then up again (blocking).
fn wire_down_for(down: Duration) {
    ip_link_set(&["down"]);
    std::thread::sleep(down);
    ip_link_set(&["up"]);
}

/// The wire NIC of guest b goes down for 10 s under 8 idle streams, and
/// stays up on guest a: b's streams fail with `PortDown` (`NetworkDown`),
/// once the port stayed down for the RC retry bound or, on Soft-RoCE, as
/// soon as their keepalive probe (1 s) cannot leave the netdev, and a
/// connect on b fails at once with `Unreachable` (no route to a while its
/// interface is down); a's streams fail by their keepalive
/// probe (`ConnectionReset`; `TimedOut` on iWARP), never EOF and never a
/// hang. Once b's link is back, a new stream between the two hosts echoes
/// exact, and b's resources are back where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o_a_link_down_on_one_host_fails_both_sides_typed_and_heals() {
    const PORT: u16 = 7830;
    const STREAMS: usize = 8;
    const DOWN: Duration = Duration::from_secs(10);
    let keepalive = Duration::from_secs(1);
    let cfg = RdmaConfig::new().keepalive(Some(keepalive));
    match role() {
        Role::Server => {
            let l = RdmaListener::bind_with(at(PORT), &cfg).await.unwrap();
            // b's first stream opens its device (kept for the process)
            // before it counts its resources.
            let (s, _) = l.accept().await.unwrap();
            assert_eq!(echo(s).await.unwrap(), 1);
            let mut streams = Vec::new();
            for _ in 0..STREAMS {
                let (mut s, _) = l.accept().await.unwrap();
                let mut one = [0u8; 1];
                s.read_exact(&mut one).await.unwrap();
                s.write_all(&one).await.unwrap();
                streams.push(s);
            }
            drop(l);
            for (k, mut s) in streams.into_iter().enumerate() {
                let mut buf = [0u8; 16];
                let e = tokio::time::timeout(Duration::from_secs(60), s.read(&mut buf))
                    .await
                    .expect("a's side notices")
                    .expect_err("no byte and no EOF");
                if common::iwarp() {
                    assert_eq!(e.kind(), io::ErrorKind::TimedOut, "stream {k}: {e}");
                } else {
                    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "stream {k}: {e}");
                }
            }
            let l = RdmaListener::bind_with(at(PORT + 1), &cfg).await.unwrap();
            let (s, _) = tokio::time::timeout(Duration::from_secs(120), l.accept())
                .await
                .expect("b connects once its link is back")
                .unwrap();
            assert_eq!(echo(s).await.unwrap(), 1 << 20);
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            echo_client(connect(PORT, &cfg).await, 32, 1).await;
            common::background_delivery_done(DELIVERY).await;
            // The warm-up's rdma_cm id is destroyed off the runtime after
            // its QP: wait for it too (this side holds no other id).
            cm_ids_destroyed("the warm-up's id").await;
            let (start, fds) = (tokio_rdma::stats::resources(), open_fds());
            let mut streams = Vec::new();
            for k in 0..STREAMS {
                let mut s = connect(PORT, &cfg).await;
                s.write_all(&[k as u8]).await.unwrap();
                let mut one = [0u8; 1];
                s.read_exact(&mut one).await.unwrap();
                assert_eq!(one, [k as u8]);
                streams.push(s);
            }
            let _up = RestoreNic::link_up();
            let t0 = Instant::now();
            let down = tokio::task::spawn_blocking(|| wire_down_for(DOWN));
            for (k, mut s) in streams.into_iter().enumerate() {
                let mut buf = [0u8; 16];
                let e = tokio::time::timeout(Duration::from_secs(8), s.read(&mut buf))
                    .await
                    .expect("the read fails while the link is still down")
                    .expect_err("no byte and no EOF");
                assert_eq!(e.kind(), io::ErrorKind::NetworkDown, "stream {k}: {e:?}");
                match tokio_rdma::Error::from_io(&e) {
                    Some(tokio_rdma::Error::PortDown {
                        device,
                        port: 1,
                        after,
                    }) => {
                        assert_eq!(*device, common::device());
                        assert!(*after < DOWN, "stream {k}: down for {after:?}");
                    }
                    other => panic!("stream {k}: expected PortDown, got {other:?}"),
                }
                tokio::time::timeout(Duration::from_secs(2), async { drop(s) })
                    .await
                    .expect("drop returns");
            }
            // With its interface down the host has no route to a: the
            // connect fails at address resolution, as a TCP connect does
            // (ENETUNREACH).
            let e = RdmaStream::connect_with(at(PORT + 1), &cfg)
                .await
                .expect_err("the link is down");
            assert_eq!(e.kind(), io::ErrorKind::NetworkUnreachable, "{e:?}");
            match tokio_rdma::Error::from_io(&e) {
                Some(tokio_rdma::Error::Unreachable { addr, source }) => {
                    assert_eq!(*addr, at(PORT + 1));
                    assert_eq!(source.raw_os_error(), Some(libc::ENETUNREACH), "{e:?}");
                }
                other => panic!("expected Unreachable, got {other:?}"),
            }
            assert!(
                !down.is_finished(),
                "the link came back before the checks: {:?}",
                t0.elapsed()
            );
            down.await.unwrap();
            echo_client(connect(PORT + 1, &cfg).await, 31, 1 << 20).await;
            common::background_delivery_done(DELIVERY).await;
            assert_back_to(start, fds, 4, Duration::from_secs(30)).await;
        }
    }
}

/// Guest b's wire NIC goes down for 200 ms under 8 streams (retry bound
/// about 1.9 s, `wire()`), 4 idle and 4 echoing 64 KiB blocks: the idle
/// ones ride it out (each echoes exact afterwards); each busy one ends
/// exact or with a typed error on both hosts (Soft-RoCE fails a send at
/// once while its netdev is down: `PortDown` on b, then `ConnectionReset`
/// or `ConnectionAborted` on a), none hangs; a new stream echoes exact.
///
/// Soft-RoCE (Linux 6.1) sometimes leaves a busy stream's QP in RTS with
/// sends that never complete nor fail once its link came back (in 2 or 3
/// runs of 12; the stream's state, printed by [`watchdog`], shows the WRs
/// outstanding and no error). The keepalive (30 s) then probes it and
/// fails it with `TimedOut` a period later, which the peer sees as
/// `ConnectionReset`: within [`WEDGED`] of the link going down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_a_short_link_down_on_one_host_rides_out_idle_streams() {
    const PORT: u16 = 7832;
    const IDLE: usize = 4;
    const BUSY: usize = 4;
    // The default keepalive (30 s): see `WEDGED`.
    let cfg = wire();
    let typed = |e: &io::Error, kinds: &[io::ErrorKind]| {
        assert!(kinds.contains(&e.kind()), "{e:?}");
        assert!(tokio_rdma::Error::from_io(e).is_some(), "typed: {e:?}");
    };
    match role() {
        Role::Server => {
            let l = RdmaListener::bind_with(at(PORT), &cfg).await.unwrap();
            let mut echoes = Vec::new();
            let mut probes = Vec::new();
            for k in 0..IDLE + BUSY + 1 {
                let (s, _) = tokio::time::timeout(Duration::from_secs(120), l.accept())
                    .await
                    .expect("b connects")
                    .unwrap();
                probes.push((k, tokio_rdma::__testing::probe(&s)));
                echoes.push(tokio::spawn(echo(s)));
            }
            let _watch = watchdog("a", probes, Duration::from_secs(20));
            let (mut exact, mut failed) = (0, 0);
            for (k, e) in echoes.into_iter().enumerate() {
                match tokio::time::timeout(Duration::from_secs(120), e)
                    .await
                    .expect("no stream hangs")
                    .unwrap()
                {
                    Ok(_) => exact += 1,
                    Err(e) if (IDLE..IDLE + BUSY).contains(&k) => {
                        typed(
                            &e,
                            &[
                                io::ErrorKind::ConnectionReset,
                                io::ErrorKind::ConnectionAborted,
                                io::ErrorKind::TimedOut,
                            ],
                        );
                        failed += 1;
                    }
                    Err(e) => panic!("stream {k} (idle or new): {e:?}"),
                }
            }
            println!("a: {exact} streams ended exact, {failed} failed typed");
            common::background_delivery_done(DELIVERY).await;
        }
        Role::Client => {
            let mut idle = Vec::new();
            for _ in 0..IDLE {
                idle.push(connect(PORT, &cfg).await);
            }
            let (stop_tx, stop) = tokio::sync::watch::channel(false);
            let mut busy = Vec::new();
            let mut probes = Vec::new();
            for k in 0..BUSY {
                let s = connect(PORT, &cfg).await;
                probes.push((IDLE + k, tokio_rdma::__testing::probe(&s)));
                busy.push(tokio::spawn(blocks_until(s, 70 + k as u64, stop.clone())));
            }
            let _up = RestoreNic::link_up();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let t0 = Instant::now();
            tokio::task::spawn_blocking(|| wire_down_for(Duration::from_millis(200)))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop_tx.send_replace(true);
            let _watch = watchdog("b", probes, Duration::from_secs(15));
            let (mut exact, mut failed) = (0, 0);
            for b in busy {
                match tokio::time::timeout(WEDGED, b)
                    .await
                    .expect("no stream hangs")
                    .unwrap()
                {
                    Ok(n) => {
                        assert!(n >= 64 * 1024);
                        exact += 1;
                    }
                    Err(e) => {
                        println!("b: {e:?} {:?} after the link went down", t0.elapsed());
                        typed(
                            &e,
                            &[
                                io::ErrorKind::NetworkDown,
                                io::ErrorKind::ConnectionReset,
                                io::ErrorKind::ConnectionAborted,
                                io::ErrorKind::TimedOut,
                            ],
                        );
                        failed += 1;
                    }
                }
            }
            println!("b: {exact} busy streams ended exact, {failed} failed typed");
            for (k, s) in idle.into_iter().enumerate() {
                echo_client(s, 80 + k as u64, 64 * 1024).await;
            }
            echo_client(connect(PORT, &cfg).await, 90, 1 << 20).await;
            common::background_delivery_done(DELIVERY).await;
        }
    }
}

/// How long a busy stream of the 200 ms link-down test may take to end
/// after the link went down: a QP Soft-RoCE wedged fails by its keepalive
/// two periods (2 x 30 s) after its last completion, plus a margin.
const WEDGED: Duration = Duration::from_secs(90);

/// Prints, `after` from now and every 10 s after that, the state of each
/// stream of `probes` still open (its index in the test, then
/// [`tokio_rdma::__testing::StreamProbe::dump`]): what a stream that
/// stopped moving holds and waits on, on the side that notices (the
/// client) and the other. Stops when the handle is dropped.
fn watchdog(
    side: &'static str,
    probes: Vec<(usize, tokio_rdma::__testing::StreamProbe)>,
    after: Duration,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        tokio::time::sleep(after).await;
        loop {
            for (k, p) in &probes {
                if let Some(d) = p.dump() {
                    println!("{side}: stream {k} still open: {d}");
                }
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
    }))
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// 64 KiB blocks of a pattern echoed exact until `stop`
/// ([`common::echo_blocks_until`]); the bytes echoed, or the first error.
async fn blocks_until(
    s: RdmaStream,
    seed: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> io::Result<u64> {
    common::echo_blocks_until(s, pattern_buf(seed, 64 * 1024), stop)
        .await
        .map_err(|(e, _)| e)
}

/// Guest a is killed (the host crashes) while three connections to it are
/// idle, uploading and downloading, and a message endpoint holds grants
/// both ways: each stream fails within the keepalive and retry bounds
/// with `ConnectionReset` (`TimedOut` from the keepalive on iWARP), never
/// EOF, different bytes or a hang. On the endpoint, b's one-sided WRITEs
/// and READs of a's grant (4 KiB each, every 10 ms, each READ checked
/// against the WRITE before it) fail typed, b's own grant to a revokes
/// `Ok` (its window died with the QP), and with the endpoint, the region
/// and the endpoint's own pool dropped this process's resources go back
/// to where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_peer_host_crash_is_an_error_idle_or_mid_transfer() {
    use tokio_rdma::pool::{MemoryPool, PoolConfig};
    use tokio_rdma::remote::{GrantAccess, LocalRegion, RemoteRegion};
    const PORT: u16 = 7899;
    const GRANT: usize = 1 << 20;
    let keepalive = Duration::from_secs(2);
    let cfg = RdmaConfig::new().keepalive(Some(keepalive));
    match role() {
        Role::Server => {
            // The endpoint: grant b 1 MiB, take b's grant, and READ it
            // every 10 ms until this host is killed.
            let mcfg = MessageConfig::new().connection(cfg.clone());
            let ml = MessageListener::bind_with(at(PORT - 1), &mcfg)
                .await
                .unwrap();
            tokio::spawn(async move {
                // b's warm-up endpoint: one message back, then kept until
                // b closes it.
                let (warm, _) = ml.accept().await.unwrap();
                let m = warm.recv().await.unwrap().unwrap();
                warm.send_copy(&m).await.unwrap();
                let _ = warm.recv().await;
                drop(warm);
                let (ep, _) = ml.accept().await.unwrap();
                let region = LocalRegion::new(ep.pool().alloc_any(GRANT).await.unwrap());
                let grant = ep
                    .grant(&region, 0..GRANT, GrantAccess::READ | GrantAccess::WRITE)
                    .await
                    .unwrap();
                ep.send_copy(&grant.remote().encode()).await.unwrap();
                let theirs = RemoteRegion::decode(&ep.recv().await.unwrap().unwrap()).unwrap();
                loop {
                    ep.read(&theirs, 0, 4096).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
            let l = RdmaListener::bind_with(at(PORT), &cfg).await.unwrap();
            let (warm, _) = l.accept().await.unwrap();
            assert_eq!(echo(warm).await.unwrap(), 1);
            let (_idle, _) = l.accept().await.unwrap();
            let (mut busy, _) = l.accept().await.unwrap();
            let (mut down, _) = l.accept().await.unwrap();
            // 64 MiB (the 1 MiB block 64 times), again and again, until
            // this host is killed.
            tokio::spawn(async move {
                let block = pattern_buf(21, CRASH_BLOCK);
                loop {
                    for _ in 0..64 {
                        down.write_all(&block).await.unwrap();
                    }
                }
            });
            // Read (and drop) the busy connection's bytes until this host is
            // killed.
            let mut buf = vec![0u8; 64 * 1024];
            while busy.read(&mut buf).await.unwrap() > 0 {}
            tokio::time::sleep(Duration::from_secs(600)).await;
            panic!("guest a was not killed");
        }
        Role::Client => {
            common::background_delivery_done(DELIVERY).await;
            // The endpoint's pool, of its own (dropped at the end, so its
            // slabs count in the resources); it opens the device (its PD
            // and fds stay open, by design) before counting.
            let pool = MemoryPool::for_device(
                &common::device(),
                PoolConfig::new().max_registered_bytes(16 << 20),
            )
            .unwrap();
            // A stream and a message endpoint (on the default pool) first:
            // they open what the process keeps for every later connection
            // (the runtime's completion channels, the rdma_cm event
            // channel), whichever tests ran before this one.
            echo_client(connect(PORT, &cfg).await, 22, 1).await;
            let warm_cfg = MessageConfig::new().connection(cfg.clone());
            let warm = retry(TRIES, || {
                MessageEndpoint::connect_with(at(PORT - 1), &warm_cfg)
            })
            .await;
            warm.send_copy(b"warm-up").await.unwrap();
            assert_eq!(&warm.recv().await.unwrap().unwrap()[..], b"warm-up");
            drop(warm);
            common::background_delivery_done(DELIVERY).await;
            cm_ids_destroyed("the warm-ups' ids").await;
            let (start, fds) = (tokio_rdma::stats::resources(), open_fds());
            let mut s = connect(PORT, &cfg).await;
            let mut busy = connect(PORT, &cfg).await;
            let mut down = connect(PORT, &cfg).await;
            let mcfg = MessageConfig::new()
                .connection(cfg.clone())
                .pool(pool.clone());
            let ep = retry(TRIES, || MessageEndpoint::connect_with(at(PORT - 1), &mcfg)).await;
            let theirs = RemoteRegion::decode(&ep.recv().await.unwrap().unwrap()).unwrap();
            // (`ep.pool()`: on iWARP the connection's own pool, on its PD.)
            let mine = LocalRegion::new(ep.pool().alloc_any(GRANT).await.unwrap());
            let my_grant = ep.grant(&mine, 0..GRANT, GrantAccess::READ).await.unwrap();
            ep.send_copy(&my_grant.remote().encode()).await.unwrap();
            let ep = std::sync::Arc::new(ep);
            let remote_ops = tokio::spawn({
                let ep = std::sync::Arc::clone(&ep);
                async move {
                    let mut done = 0u64;
                    loop {
                        let at = (done as usize * 4096) % GRANT;
                        let block = pattern_buf(30 + done % 7, 4096);
                        let r = async {
                            ep.write(&theirs, at as u64, &block).await?;
                            ep.read(&theirs, at as u64, 4096).await
                        }
                        .await;
                        match r {
                            Ok(back) => assert!(back[..] == block[..], "READ {done} after WRITE"),
                            Err(e) => return (e, done),
                        }
                        done += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            });
            let downloader = tokio::spawn(async move {
                let block = pattern_buf(21, CRASH_BLOCK);
                let mut buf = vec![0u8; 64 * 1024];
                let mut got = 0usize;
                loop {
                    let n = match down.read(&mut buf).await {
                        Ok(0) => return Err(format!("EOF after {got} bytes")),
                        Ok(n) => n,
                        Err(e) => return Ok((e, got)),
                    };
                    for (k, b) in buf[..n].iter().enumerate() {
                        let at = (got + k) % CRASH_BLOCK;
                        if *b != block[at] {
                            return Err(format!("byte {} differs", got + k));
                        }
                    }
                    got += n;
                }
            });
            let writer = tokio::spawn(async move {
                let chunk = pattern_buf(9, 64 * 1024);
                let mut sent = 0u64;
                loop {
                    if let Err(e) = busy.write_all(&chunk).await {
                        return (e, sent);
                    }
                    sent += chunk.len() as u64;
                }
            });
            // Idle first, longer than the keepalive: probes succeed.
            tokio::time::sleep(keepalive * 2).await;
            let reader = tokio::spawn(async move {
                let mut one = [0u8; 1];
                let r = s.read(&mut one).await;
                (r, Instant::now())
            });
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(!reader.is_finished(), "the probes kept the connection up");
            let ctl = std::path::PathBuf::from(std::env::var("SOFTROCE_CTL").unwrap());
            std::fs::write(ctl.join("kill-a"), b"").unwrap();
            let asked = Instant::now();
            for _ in 0..600 {
                if ctl.join("done-kill-a").exists() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(
                ctl.join("done-kill-a").exists(),
                "the harness killed guest a"
            );
            let bound = keepalive + cfg.retry_bound();
            let (r, when) = tokio::time::timeout(bound * 3 + Duration::from_secs(5), reader)
                .await
                .expect("the dead peer is detected")
                .unwrap();
            let err = r.expect_err("a vanished host is an error, never EOF");
            // RC's retry bound fails the probe (a WorkCompletion error);
            // iWARP has no such bound below TCP's own (minutes): a probe
            // unanswered for a whole keepalive period is KeepaliveTimeout.
            let iwarp = common::iwarp();
            let dead = if iwarp {
                io::ErrorKind::TimedOut
            } else {
                io::ErrorKind::ConnectionReset
            };
            assert_eq!(err.kind(), dead, "{err}");
            assert!(
                matches!(
                    tokio_rdma::Error::from_io(&err),
                    Some(tokio_rdma::Error::WorkCompletion { .. }) if !iwarp
                ) || matches!(
                    tokio_rdma::Error::from_io(&err),
                    Some(tokio_rdma::Error::KeepaliveTimeout { idle }) if iwarp && *idle == keepalive
                ),
                "{err:?}"
            );
            eprintln!(
                "peer crash detected {:?} after the kill request (bound {bound:?})",
                when - asked
            );
            // A writer's (or a one-sided operation's) typed error once the
            // peer is gone.
            let assert_peer_gone = |e: &io::Error| {
                assert!(
                    matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                    ) || (iwarp && e.kind() == io::ErrorKind::TimedOut),
                    "{e}"
                );
                assert!(tokio_rdma::Error::from_io(e).is_some(), "{e:?}");
            };
            let (werr, sent) = tokio::time::timeout(bound * 3 + Duration::from_secs(5), writer)
                .await
                .expect("the writer of the busy connection fails")
                .unwrap();
            assert!(sent > 0, "the transfer was under way");
            assert_peer_gone(&werr);
            let (rerr, got) = tokio::time::timeout(bound * 3 + Duration::from_secs(5), downloader)
                .await
                .expect("the reader of the download fails")
                .unwrap()
                .expect("an error, never EOF or different bytes");
            assert!(got > 0, "the download was under way");
            assert_eq!(rerr.kind(), dead, "{rerr}");
            eprintln!("download read {got} bytes before the crash; sent {sent} bytes");
            let (oerr, done) = tokio::time::timeout(bound * 3 + Duration::from_secs(5), remote_ops)
                .await
                .expect("the one-sided operations fail")
                .unwrap();
            assert!(done > 0, "one-sided operations ran before the crash");
            assert_peer_gone(&oerr);
            eprintln!("{done} WRITE+READ pairs on a's grant before the crash: {oerr}");
            my_grant
                .revoke()
                .await
                .expect("a grant on a failed endpoint revokes Ok");
            let ep = std::sync::Arc::into_inner(ep).expect("the last handle");
            // The config holds a handle of the pool too.
            drop((ep, mine, mcfg, pool));
            assert_back_to(start, fds, 2, Duration::from_secs(120)).await;
        }
    }
}
