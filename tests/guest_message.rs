//! Guest tests of the zero-copy message endpoint on the guest's soft
//! device (`common::device()`: rxe0, or siw0 with `--provider siw`; needs
//! the Soft-RoCE guest: `integration/softroce run -- ...`). Fails, never
//! skips, without a device.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it), so
//! host builds (`cargo test --all-features` included) leave it empty.
#![cfg(tokio_rdma_guest)]

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_rdma::message::MessageStats;
use tokio_rdma::pool::{ExhaustedPolicy, MemoryPool, PoolConfig};
use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener, PoolBytes};

mod common;
use common::{Phases, example, retry, signal};

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

const IP: &str = "10.11.0.1";
const MIB: usize = 1024 * 1024;

/// Deterministic content of message `seed` (`shared::pattern_byte` for
/// each index): no period shorter than 2^64 bytes, so bytes from a stale
/// lap of a ring never match.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    shared::pattern_vec(seed, len)
}

fn crc(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

async fn pair(
    server: &MessageConfig,
    client: &MessageConfig,
) -> (MessageEndpoint, MessageEndpoint) {
    if std::env::var_os("MSG_TRACE").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .try_init();
    }
    let listener = MessageListener::bind_with(format!("{IP}:0"), server)
        .await
        .expect("bind on the device's address");
    let addr = listener.local_addr().unwrap();
    let (c, s) = tokio::join!(
        MessageEndpoint::connect_with(addr, client),
        listener.accept()
    );
    (c.expect("connect"), s.expect("accept").0)
}

async fn send_pattern(ep: &MessageEndpoint, seed: u64, len: usize) -> u64 {
    let mut buf = ep.pool().alloc_any(len).await.expect("pool buffer");
    buf.spare_mut()[..len].copy_from_slice(&pattern(seed, len));
    buf.set_len(len);
    let addr = buf.addr();
    ep.send(buf).await.expect("send");
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_arrive_intact_in_order_and_in_pool_memory() {
    // The word-at-a-time pattern is the byte-at-a-time one.
    assert_eq!(
        pattern(5, 21),
        (0..21)
            .map(|i| shared::pattern_byte(5, i))
            .collect::<Vec<u8>>()
    );
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    let sizes = [0, 1, 4096, 4097, MIB, 64 * MIB];
    let sender = tokio::spawn(async move {
        for (i, &len) in sizes.iter().enumerate() {
            send_pattern(&client, i as u64, len).await;
        }
        client.flush().await.expect("flush");
        let stats = client.stats();
        client.close().await.expect("close");
        stats
    });
    for (i, &len) in sizes.iter().enumerate() {
        let msg: PoolBytes = server.recv().await.expect("recv").expect("a message");
        assert_eq!(msg.len(), len, "message {i} length");
        let want = pattern(i as u64, len);
        assert_eq!(crc(&msg), crc(&want), "message {i} checksum");
        assert!(msg[..] == want[..], "message {i} bytes");
        if len > 0 {
            assert!(
                server.pool().owns(msg.as_ptr(), msg.len()),
                "message {i} lies in a pool slab"
            );
            assert_eq!(msg.addr(), msg.as_ptr() as u64);
            let bytes = msg.clone().into_bytes();
            assert_eq!(bytes.as_ptr(), msg.as_ptr(), "into_bytes does not copy");
        }
    }
    let sent: MessageStats = sender.await.unwrap();
    assert_eq!(sent.messages_sent, 6);
    // 0, 1 and 4096 bytes go eagerly (eager_max 4096); the rest by
    // rendezvous. On iWARP each SEND ends in its immediate's 4-byte
    // trailer (eager_max 4092): 4096 bytes go by rendezvous there.
    let (eager, read) = if common::iwarp() {
        (2, 4096 + 4097 + MIB + 64 * MIB)
    } else {
        (3, 4097 + MIB + 64 * MIB)
    };
    assert_eq!(sent.eager_sent, eager);
    assert_eq!(sent.rendezvous_sent, 6 - eager);
    let got = server.stats();
    assert_eq!(got.messages_received, 6);
    assert_eq!(got.bytes_received, sizes.iter().sum::<usize>() as u64);
    assert_eq!(got.read_bytes, read as u64);
    // The peer closed (and `close` returned only once it had disconnected):
    // end of stream.
    let end = tokio::time::timeout(Duration::from_secs(20), server.recv())
        .await
        .expect("end of stream in time");
    assert!(matches!(end, Ok(None)), "clean end, got {end:?}");
}

/// The client's close reaches the server as a CLOSE message before the
/// disconnect: exactly one more control message arrives, `recv` returns
/// what came first and then `None`, and a send fails with `BrokenPipe`, as
/// a write after a TCP peer's close would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peers_close_arrives_as_close_then_ends_recv_and_send() {
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    send_pattern(&client, 3, 100).await;
    send_pattern(&client, 4, 5000).await;
    assert_eq!(
        &server.recv().await.unwrap().unwrap()[..],
        &pattern(3, 100)[..]
    );
    let control_before = server.stats().control_received;
    let client_stats_before = client.stats();
    client.close().await.expect("clean close");
    // The rendezvous sent before the close still arrives whole.
    let msg = server.recv().await.unwrap().expect("the second message");
    assert_eq!(&msg[..], &pattern(4, 5000)[..]);
    let end = tokio::time::timeout(Duration::from_secs(20), server.recv())
        .await
        .expect("end of stream in time");
    assert!(matches!(end, Ok(None)), "clean end, got {end:?}");
    // The client sent no CREDIT (it received nothing; on iWARP only its
    // opening one, as the initiator): the one control message beyond
    // those before is its CLOSE.
    assert_eq!(client_stats_before.credits_sent, u64::from(common::iwarp()));
    assert_eq!(server.stats().control_received, control_before + 1);
    let err = server.send_copy(b"late").await.expect_err("peer closed");
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe, "{err}");
    assert!(
        matches!(server.flush().await, Ok(())),
        "nothing of ours was lost"
    );
}

/// A `recv` that waits is counted as a stream's read is: with
/// `WaitStrategy::Park` none spins, and each of 50 messages, sent only once
/// the receiver's `recv_parks` shows it parked for it, arrives intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_recv_is_counted_in_the_endpoint_stats() {
    const N: u64 = 50;
    let cfg = MessageConfig::new()
        .connection(tokio_rdma::RdmaConfig::new().wait_strategy(tokio_rdma::WaitStrategy::Park));
    let (c, s) = pair(&cfg, &cfg).await;
    let watch = s.clone();
    let receiver = tokio::spawn(async move {
        for i in 0..N {
            let m = s.recv().await.expect("recv").expect("a message");
            assert_eq!(&m[..], &pattern(i, 64)[..], "message {i}");
        }
        s.stats()
    });
    for i in 0..N {
        // Liveness bound only: the receiver parks within milliseconds.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while watch.stats().recv_parks <= i {
            assert!(
                std::time::Instant::now() < deadline,
                "recv {i} never parked: {:?}",
                watch.stats()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        send_pattern(&c, i, 64).await;
    }
    let st = receiver.await.expect("receiver");
    assert_eq!(st.messages_received, N);
    assert_eq!(st.spin_hits, 0, "{st:?}");
    // One park per message at least (more after a wake-up that brought
    // nothing, such as the completion of a CREDIT it sent).
    assert!(st.recv_parks >= N, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_send_posts_the_pool_buffer_itself() {
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    let len = 3000; // above the inline threshold, below eager_max
    let addr = send_pattern(&client, 7, len).await;
    let msg = server.recv().await.unwrap().unwrap();
    assert_eq!(msg[..], pattern(7, len)[..]);
    let sge = tokio_rdma::__testing::last_posted_sge(&client).expect("a SEND with an SGE");
    assert_eq!(sge.addr, addr, "the SEND's SGE is the buffer: no copy");
    assert_eq!(sge.len, len as u32);
    // A rendezvous: the receiver's READ lands in the delivered buffer.
    let big = 2 * MIB;
    send_pattern(&client, 8, big).await;
    let msg = server.recv().await.unwrap().unwrap();
    assert_eq!(msg[..], pattern(8, big)[..]);
    let read = tokio_rdma::__testing::last_posted_sge(&server).expect("a READ");
    let start = msg.as_ptr() as u64;
    assert!(
        read.addr >= start && read.addr + u64::from(read.len) == start + big as u64,
        "the last READ wrote the tail of the delivered buffer"
    );
}

/// A sender that goes idle right after its last message gets the
/// message's memory back without calling the endpoint again. After a
/// request and its response the CQ is armed for the peer's solicited
/// messages only, so the completion of the next SEND raises no event;
/// the driver's tick polls it if no other round does. (In this guest
/// another round usually does first, so a build without the tick was
/// seen to pass too: this is a check that nothing stays held, not of
/// which round frees it.) Then a rendezvous, whose window the DONE lets
/// the sender invalidate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_senders_buffers_come_back_without_another_call() {
    let pool = test_pool(64 * MIB, ExhaustedPolicy::Wait);
    let client_cfg = MessageConfig::new().pool(pool.clone());
    let (client, server) = pair(&client_cfg, &MessageConfig::new()).await;
    // The endpoint's pool: the configured one, or on iWARP the
    // connection's own with its settings (`MessageConfig::pool`).
    let pool = client.pool().clone();
    // The client's posted receive buffers come from the pool too, and
    // stay (a received message's buffer is replaced by a fresh one).
    let receive_buffers = pool.stats().bytes_in_use;
    assert!(receive_buffers > 0);
    let echo = server.clone();
    tokio::spawn(async move {
        let m = echo.recv().await.unwrap().unwrap();
        echo.send(m).await.unwrap();
    });
    send_pattern(&client, 0, 3000).await;
    let back = client.recv().await.unwrap().unwrap();
    assert_eq!(back[..], pattern(0, 3000)[..], "the echo");
    drop(back);
    for (seed, len) in [(1, 3000), (2, 2 * MIB)] {
        send_pattern(&client, seed, len).await;
        let msg = server.recv().await.unwrap().unwrap();
        assert_eq!(msg[..], pattern(seed, len)[..], "message {seed}");
        drop(msg);
        // Nothing is called on the client from here on; liveness bound
        // only (a tick is 5 ms).
        for _ in 0..200 {
            if pool.stats().bytes_in_use == receive_buffers {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            pool.stats().bytes_in_use,
            receive_buffers,
            "message {seed}'s buffer back in the pool"
        );
    }
    assert_eq!(client.stats().messages_sent, 3);
}

/// A receiver that answers, takes one message and then calls nothing on
/// its endpoint still has its peer's rendezvous read: READs it held back
/// while a complete message waited to be taken (an endpoint that also
/// sends does; on rxe a READ between two ends of one device runs inside
/// its post) go at the driver's next tick, so the sender's `flush` (every
/// message read by the peer) returns. The rest arrive intact afterwards.
/// Whether a hold happens depends on when the driver met the RTSs (the
/// counter is in the failure message); without the tick this timed out
/// on the multi-thread runtime. A miss is a hang, bounded here by 20 s.
async fn held_reads_go_at_the_tick_when_the_receiver_stops_taking() {
    let (client, server) = pair(&MessageConfig::new(), &MessageConfig::new()).await;
    const LEN: usize = 64 * 1024;
    for seed in 0..4 {
        send_pattern(&client, seed, LEN).await;
    }
    // The server answers as it takes (the hold is for an endpoint that
    // also sends).
    send_pattern(&server, 9, 8).await;
    let first = server.recv().await.expect("recv").expect("a message");
    assert_eq!(first[..], pattern(0, LEN)[..], "message 0");
    drop(first);
    // Nothing is called on the server from here until the flush returned.
    let flushed = tokio::time::timeout(Duration::from_secs(20), client.flush()).await;
    assert!(
        matches!(flushed, Ok(Ok(()))),
        "flush: {flushed:?}; client {:?}; server {:?}",
        client.stats(),
        server.stats()
    );
    for seed in 1..4 {
        let msg = server.recv().await.expect("recv").expect("a message");
        assert_eq!(msg[..], pattern(seed, LEN)[..], "message {seed}");
    }
    let stats = server.stats();
    assert_eq!(stats.rendezvous_received, 4, "{stats:?}");
    assert_eq!(stats.read_bytes, 4 * LEN as u64);
    let answer = client.recv().await.expect("recv").expect("the answer");
    assert_eq!(answer[..], pattern(9, 8)[..]);
    client.close().await.expect("close");
    assert!(server.recv().await.expect("recv after close").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_reads_go_at_the_tick_when_the_receiver_stops_taking_multi_thread() {
    held_reads_go_at_the_tick_when_the_receiver_stops_taking().await;
}

#[tokio::test(flavor = "current_thread")]
async fn held_reads_go_at_the_tick_when_the_receiver_stops_taking_current_thread() {
    held_reads_go_at_the_tick_when_the_receiver_stops_taking().await;
}

/// A sustained stream (sending through more than one of the driver's
/// 5 ms ticks) leaves its queue to itself and the tick, not to the next
/// completion: its last messages, left queued by `send()` with 4 WRs or
/// more outstanding, still arrive, in order, with nothing called on the
/// sender after them. Both runtimes: on current_thread the driver runs
/// only when the sender yields.
async fn a_streams_last_queued_messages_arrive_without_another_call() {
    let (client, server) = pair(&MessageConfig::new(), &MessageConfig::new()).await;
    // The receiver takes messages as they come (its credit goes back
    // only as it takes them) and reports how many, in order.
    let (count_tx, mut count_rx) = tokio::sync::watch::channel(0u64);
    let receiver = tokio::spawn(async move {
        let mut i = 0u64;
        while let Some(msg) = server.recv().await.expect("recv") {
            assert_eq!(msg[..], i.to_le_bytes(), "message {i}");
            i += 1;
            count_tx.send_replace(i);
        }
        i
    });
    // 30 ms: six tick periods (a clock read per 64 messages).
    let start = tokio::time::Instant::now();
    let mut sent = 0u64;
    while sent % 64 != 0 || start.elapsed() < Duration::from_millis(30) {
        let mut buf = client.pool().alloc_any(8).await.expect("pool buffer");
        buf.spare_mut()[..8].copy_from_slice(&sent.to_le_bytes());
        buf.set_len(8);
        client.send(buf).await.expect("send");
        sent += 1;
    }
    // Nothing is called on the client from here on; liveness bound only.
    let all = tokio::time::timeout(Duration::from_secs(20), count_rx.wait_for(|&n| n == sent))
        .await
        .is_ok_and(|r| r.is_ok());
    assert!(all, "{} of {sent} messages arrived", *count_rx.borrow());
    let stats = client.stats();
    assert_eq!(stats.messages_sent, sent);
    assert!(stats.sends_deferred > 0, "{stats:?}");
    client.close().await.expect("close");
    assert_eq!(receiver.await.expect("receiver"), sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_last_queued_messages_arrive_without_another_call_multi_thread() {
    a_streams_last_queued_messages_arrive_without_another_call().await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_streams_last_queued_messages_arrive_without_another_call_current_thread() {
    a_streams_last_queued_messages_arrive_without_another_call().await;
}

/// A `recv` parked with its CQ armed for solicited events only still
/// polls the CREDITs its peer spent its credit on: the CREDIT that leaves
/// the peer at the reserve (2) is solicited, the receiver returns credit
/// for them, and the peer's reply goes. This endpoint posts 4 receive
/// buffers; the peer (12 buffers) returns credit by a CREDIT every 3
/// messages it takes, and each CREDIT takes one of the 4. No keepalive: a
/// miss is a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_recv_returns_the_credit_its_peers_credits_took() {
    let small = MessageConfig::new().connection(
        tokio_rdma::RdmaConfig::new()
            .recv_queue_depth(4)
            .keepalive(None),
    );
    // 12 buffers, all posted at once: a CREDIT for every 3 taken.
    let peer_cfg =
        MessageConfig::new().connection(tokio_rdma::RdmaConfig::new().recv_queue_depth(12));
    let (client, server) = pair(&peer_cfg, &small).await;
    let peer = tokio::spawn(async move {
        // Past the client's last ticks (5 ms each): only its parked recv
        // may look at its CQ.
        tokio::time::sleep(Duration::from_millis(50)).await;
        for i in 0..6u64 {
            let m = server.recv().await.expect("recv").expect("a message");
            assert_eq!(m[..], i.to_le_bytes(), "message {i}");
        }
        server.send_copy(b"reply").await.expect("send the reply");
        server
    });
    for i in 0..6u64 {
        client.send_copy(&i.to_le_bytes()).await.expect("send");
    }
    let reply = tokio::time::timeout(Duration::from_secs(10), client.recv())
        .await
        .expect("the reply within 10 s")
        .expect("recv")
        .expect("a message");
    assert_eq!(&reply[..], b"reply");
    let server = peer.await.expect("peer task");
    // Two CREDITs of 3 (the second solicited), none carried by an EAGER.
    assert_eq!(server.stats().credits_sent, 2);
    // (On iWARP the initiator's opening CREDIT comes first.)
    assert_eq!(
        client.stats().credits_sent,
        1 + u64::from(common::iwarp()),
        "the credit returned"
    );
}

/// A sender's `close` long after its last message (its driver no longer
/// ticking) returns while the peer still holds its endpoint: the CLOSE is
/// posted before the driver arms the CQ, so its completion raises an event.
/// No keepalive: a miss is a hang until the peer goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_after_a_quiet_stream_returns_while_the_peer_holds_on() {
    let quiet = MessageConfig::new().connection(tokio_rdma::RdmaConfig::new().keepalive(None));
    let (client, server) = pair(&MessageConfig::new(), &quiet).await;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let peer = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(m) = server.recv().await.expect("recv") {
            assert_eq!(m[..], n.to_le_bytes(), "message {n}");
            n += 1;
        }
        // Held until the client's close returned.
        let _ = done_rx.await;
        n
    });
    for i in 0..1000u64 {
        client.send_copy(&i.to_le_bytes()).await.expect("send");
    }
    client.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let closed = tokio::time::timeout(Duration::from_secs(10), client.close()).await;
    let _ = done_tx.send(());
    assert!(matches!(closed, Ok(Ok(()))), "{closed:?}");
    assert_eq!(peer.await.expect("peer task"), 1000);
}

fn is_kind(e: &io::Error, kind: io::ErrorKind) -> bool {
    e.kind() == kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_above_the_receivers_limit_fails_locally() {
    // The limit is agreed at connect (the smaller one): the sender refuses
    // a message the receiver would refuse, with `InvalidInput`, and the
    // connection goes on. (A peer that announces one anyway is a protocol
    // error at the receiver, with ABORT code 5: the protocol core's tests.)
    let server_cfg = MessageConfig::new().max_message_len(MIB as u64);
    let client_cfg = MessageConfig::new();
    let (client, server) = pair(&server_cfg, &client_cfg).await;
    let mut buf = client.pool().alloc_any(2 * MIB).await.unwrap();
    buf.set_len(2 * MIB);
    let err = client.send(buf).await.unwrap_err();
    assert!(is_kind(&err, io::ErrorKind::InvalidInput), "{err}");
    assert!(
        err.to_string().contains("2097152") && err.to_string().contains("1048576"),
        "{err}"
    );
    send_pattern(&client, 1, MIB).await;
    let msg = server
        .recv()
        .await
        .unwrap()
        .expect("the message at the limit");
    assert!(msg[..] == pattern(1, MIB)[..]);
    client.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_outside_the_registration_fails_without_touching_memory() {
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    // A real region, announced with a range beyond its end.
    let region = client.pool().register_vec(vec![0xAB; 64 * 1024]).unwrap();
    tokio_rdma::__testing::send_forged_rts(&client, MIB as u64, region.addr(), region.rkey())
        .unwrap();
    let err = server
        .recv()
        .await
        .expect_err("READ outside the region fails");
    assert!(is_remote_access_error(&err), "{err:?}");
    if !common::iwarp() {
        assert!(is_kind(&err, io::ErrorKind::InvalidData), "{err}");
        assert!(err.to_string().contains("remote access"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_receiver_pool_with_error_policy_aborts_and_frees_everything() {
    let small = MemoryPool::for_device(
        &common::device(),
        PoolConfig::new()
            .max_registered_bytes(4 * MIB as u64)
            .exhausted_policy(ExhaustedPolicy::Error),
    )
    .unwrap();
    let server_cfg = MessageConfig::new().pool(small.clone());
    let (client, server) = pair(&server_cfg, &MessageConfig::new()).await;
    // The configured pool, or on iWARP the connection's own with its
    // settings.
    let small = server.pool().clone();
    let before = small.stats();
    // 8 MiB cannot fit a 4 MiB pool.
    send_pattern(&client, 3, 8 * MIB).await;
    let err = server.recv().await.expect_err("no memory for it");
    assert!(is_kind(&err, io::ErrorKind::OutOfMemory), "{err}");
    let err = client.flush().await.expect_err("sender sees the abort");
    assert!(is_kind(&err, io::ErrorKind::ConnectionReset), "{err}");
    assert_eq!(
        before.bytes_in_use,
        15 * 4096,
        "the posted receive buffers (15 at first)"
    );
    drop(server);
    drop(client);
    wait_in_use_zero(&small).await;
    assert_eq!(
        small.stats().bytes_in_use,
        0,
        "every buffer back in the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_receiver_pool_with_wait_policy_waits_for_the_application() {
    let small = MemoryPool::for_device(
        &common::device(),
        PoolConfig::new()
            .max_registered_bytes(16 * MIB as u64)
            .exhausted_policy(ExhaustedPolicy::Wait),
    )
    .unwrap();
    let server_cfg = MessageConfig::new().pool(small.clone());
    let (client, server) = pair(&server_cfg, &MessageConfig::new()).await;
    let sender = tokio::spawn(async move {
        for seed in 0..3 {
            send_pattern(&client, seed, 5 * MIB).await;
        }
        client.flush().await.unwrap();
        client
    });
    // A 4 MiB slab of receive buffers + 2 x 5 MiB fit in 16 MiB; the third
    // 5 MiB must wait until the application drops one.
    let first = server.recv().await.unwrap().unwrap();
    let second = server.recv().await.unwrap().unwrap();
    assert_eq!(first[..], pattern(0, 5 * MIB)[..]);
    assert_eq!(second[..], pattern(1, 5 * MIB)[..]);
    let third = tokio::time::timeout(Duration::from_millis(500), server.recv()).await;
    assert!(third.is_err(), "the third message waits for pool memory");
    drop(first);
    let third = server.recv().await.unwrap().unwrap();
    assert_eq!(third[..], pattern(2, 5 * MIB)[..]);
    drop((second, third));
    let client = sender.await.unwrap();
    drop(client);
    assert!(matches!(server.recv().await, Ok(None)));
    drop(server);
    for _ in 0..100 {
        if small.stats().bytes_in_use == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(small.stats().bytes_in_use, 0);
}

fn test_pool(max: usize, policy: ExhaustedPolicy) -> MemoryPool {
    MemoryPool::for_device(
        &common::device(),
        PoolConfig::new()
            .max_registered_bytes(max as u64)
            .exhausted_policy(policy),
    )
    .expect("the test device must exist in the guest")
}

async fn wait_in_use_zero(pool: &MemoryPool) {
    for _ in 0..200 {
        if pool.stats().bytes_in_use == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        pool.stats().bytes_in_use,
        0,
        "every buffer back in the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_message_arrives_intact_from_user_memory() {
    const GIB: usize = 1 << 30;
    let mut phases = Phases::start();
    let server_pool = test_pool(GIB + 64 * MIB, ExhaustedPolicy::Error);
    let server_cfg = MessageConfig::new()
        .pool(server_pool.clone())
        .max_message_len(GIB as u64);
    let client_cfg = MessageConfig::new().max_message_len(GIB as u64);
    let (client, server) = pair(&server_cfg, &client_cfg).await;
    // The configured pool, or on iWARP the connection's own with its
    // settings.
    let server_pool = server.pool().clone();
    phases.done("pool and pair");
    let data = pattern(42, GIB);
    phases.done("pattern");
    let want = crc(&data);
    phases.done("crc32 of the source");
    // User memory registered for the send: no copy into the pool.
    let region = client.pool().register_vec(data).unwrap();
    let region_addr = region.addr();
    phases.done("register 1 GiB");
    client.send(region).await.unwrap();
    let msg = server.recv().await.unwrap().unwrap();
    phases.done("send and recv");
    assert_eq!(msg.len(), GIB);
    assert_eq!(crc(&msg), want, "1 GiB checksum");
    phases.done("crc32 of the message");
    assert!(server_pool.owns(msg.as_ptr(), msg.len()));
    client.flush().await.unwrap();
    assert_eq!(client.stats().rendezvous_sent, 1);
    assert_eq!(server.stats().read_bytes, GIB as u64);
    assert_eq!(
        server.stats().read_wrs,
        (GIB / (64 * 1024)) as u64,
        "64 KiB READs (the default max_read_len)"
    );
    assert_ne!(region_addr, 0);
    drop(msg);
    drop((client, server));
    wait_in_use_zero(&server_pool).await;
    phases.done("close and release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_small_messages_arrive_in_order_once() {
    // A quarter of it on Soft-iWARP, whose every message costs a TCP
    // segment in the emulated guest (a million take 127 s there), so
    // that the CI run stays within its budget.
    let n: u64 = if common::iwarp() { 250_000 } else { 1_000_000 };
    let rnr_before = rnr_counters();
    let cfg = MessageConfig::new();
    let mut phases = Phases::start();
    let (client, server) = pair(&cfg, &cfg).await;
    phases.done("pair");
    let sender = tokio::spawn(async move {
        for seq in 0..n {
            let mut buf = client.pool().alloc(8).await.unwrap();
            bytes::BufMut::put_u64(&mut buf, seq);
            client.send(buf).await.unwrap();
        }
        client.flush().await.unwrap();
        client.stats()
    });
    let mut next = 0u64;
    while let Some(msg) = server.recv().await.unwrap() {
        assert_eq!(msg.len(), 8);
        let seq = u64::from_be_bytes(msg[..].try_into().unwrap());
        assert_eq!(seq, next, "in order, none lost or duplicated");
        next += 1;
        if next == n {
            break;
        }
    }
    assert_eq!(next, n);
    phases.done("1,000,000 messages");
    let sent = sender.await.unwrap();
    assert_eq!(sent.messages_sent, n);
    assert_eq!(sent.eager_sent, n);
    assert_eq!(sent.inline_sent, n, "8 bytes go inline");
    assert_eq!(server.stats().messages_received, n);
    assert_eq!(
        rnr_counters(),
        rnr_before,
        "credit kept every SEND from meeting an empty receive queue (no RNR NAK)"
    );
}

/// The device's RNR NAK counters: (sent by the responder, received by
/// the requester). `None` on iWARP, which has no RNR NAK: a SEND that
/// meets an empty receive queue terminates the connection there (RFC
/// 5040 section 7.1), so every message arriving proves the same.
fn rnr_counters() -> Option<(u64, u64)> {
    if common::iwarp() {
        return None;
    }
    let dev = common::device();
    let read = |name: &str| -> u64 {
        let path = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trim()
            .parse()
            .unwrap()
    };
    Some((read("send_rnr_err"), read("rcvd_rnr_err")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_and_stream_carry_messages() {
    use futures::{SinkExt as _, StreamExt as _};
    let cfg = MessageConfig::new();
    let (mut client, server) = pair(&cfg, &cfg).await;
    let pool = client.pool().clone();
    let mut bufs = Vec::new();
    for i in 0..100u64 {
        let len = (i as usize * 997) % 20_000;
        let mut b = pool.alloc_any(len).await.unwrap();
        b.spare_mut()[..len].copy_from_slice(&pattern(i, len));
        b.set_len(len);
        bufs.push(Ok::<_, io::Error>(b));
    }
    client
        .send_all(&mut futures::stream::iter(bufs))
        .await
        .unwrap();
    futures::SinkExt::<tokio_rdma::PoolBuf>::close(&mut client)
        .await
        .unwrap();
    drop(client);
    let got: Vec<PoolBytes> = server.map(|m| m.unwrap()).collect::<Vec<_>>().await;
    assert_eq!(got.len(), 100);
    for (i, m) in got.iter().enumerate() {
        let len = (i * 997) % 20_000;
        assert_eq!(m[..], pattern(i as u64, len)[..], "message {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_message_endpoints_refuse_each_other() {
    use tokio_rdma::{RdmaListener, RdmaStream};
    let ml = MessageListener::bind(format!("{IP}:0")).await.unwrap();
    let err = RdmaStream::connect(ml.local_addr().unwrap())
        .await
        .expect_err("a stream cannot connect to a message listener");
    assert_wrong_kind(&err);
    let sl = RdmaListener::bind(format!("{IP}:0")).await.unwrap();
    let err = MessageEndpoint::connect(sl.local_addr().unwrap())
        .await
        .expect_err("a message endpoint cannot connect to a stream listener");
    assert_wrong_kind(&err);
}

/// Refused by the listener because the endpoint kinds differ.
fn assert_wrong_kind(err: &io::Error) {
    use tokio_rdma::error::RejectReason;
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    let inner = err
        .get_ref()
        .and_then(|e| e.downcast_ref::<tokio_rdma::Error>());
    assert!(
        matches!(
            inner,
            Some(tokio_rdma::Error::HandshakeRejected {
                reason: RejectReason::WrongKind,
                ..
            })
        ),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_killed_mid_rendezvous_is_an_error_and_leaks_nothing() {
    let pool = test_pool(256 * MIB, ExhaustedPolicy::Wait);
    // Small READs, few at a time: the 128 MiB rendezvous takes seconds, so
    // the kill lands in the middle of it.
    let cfg = MessageConfig::new()
        .pool(pool.clone())
        .max_read_len(4096)
        .connection(tokio_rdma::RdmaConfig::new().send_queue_depth(4));
    let listener = MessageListener::bind_with(format!("{IP}:0"), &cfg)
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let mut child = tokio::process::Command::new(example("bulk_transfer"))
        .args([
            "client",
            "--device",
            &common::device(),
            &addr.to_string(),
            "--bytes",
            "256MiB",
            "--message-size",
            "128MiB",
        ])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (server, _) = listener.accept().await.unwrap();
    let recv = {
        let server = server.clone();
        tokio::spawn(async move { server.recv().await })
    };
    // Kill the sender once the receiver's READs of its buffer are under way.
    let mut reading = false;
    for _ in 0..3000 {
        if server.stats().read_wrs > 0 {
            reading = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(reading, "the rendezvous started");
    child.kill().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(60), recv)
        .await
        .expect("the receiver notices")
        .unwrap();
    let err = got.expect_err("a vanished sender is an error, not a message or the end");
    // A dying process's memory regions may go before its QP: the READ then
    // fails with a remote access error (InvalidData) instead of a reset.
    // Soft-iWARP may complete a READ cut off by the dead TCP connection with
    // IBV_WC_LOC_QP_OP_ERR (ConnectionAborted).
    assert!(
        matches!(
            err.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::InvalidData
        ) || (common::iwarp() && err.kind() == io::ErrorKind::ConnectionAborted),
        "{err}"
    );
    assert_eq!(server.stats().messages_received, 0);
    drop(server);
    drop(listener);
    wait_in_use_zero(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_killed_mid_rendezvous_is_an_error_and_leaks_nothing() {
    let addr = format!("{IP}:7702");
    let mut child = tokio::process::Command::new(example("bulk_transfer"))
        .args(["server", &addr, "--device", &common::device()])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pool = test_pool(256 * MIB, ExhaustedPolicy::Wait);
    let cfg = MessageConfig::new().pool(pool.clone());
    let client = retry(1200, || MessageEndpoint::connect_with(addr.as_str(), &cfg)).await;
    let mut buf = pool.alloc_any(128 * MIB).await.unwrap();
    buf.set_len(128 * MIB);
    client.send(buf).await.unwrap();
    for _ in 0..3000 {
        if client.stats().rendezvous_sent > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(client.stats().rendezvous_sent, 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    child.kill().await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(60), client.flush())
        .await
        .expect("the sender notices")
        .expect_err("the message was never taken");
    assert!(
        matches!(
            err.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        ),
        "{err}"
    );
    drop(client);
    wait_in_use_zero(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_inline_data_payloads_and_rts_headers_go_by_sge() {
    let cfg = MessageConfig::new().connection(tokio_rdma::RdmaConfig::new().inline_threshold(0));
    let (client, server) = pair(&cfg, &cfg).await;
    // More rendezvous than send-queue slots' worth of scratch reuse, and
    // small eager messages, none inline.
    let sizes: Vec<usize> = (0..300)
        .map(|i| if i % 3 == 0 { 8 } else { 5000 + i })
        .collect();
    let sender = {
        let sizes = sizes.clone();
        tokio::spawn(async move {
            for (i, &len) in sizes.iter().enumerate() {
                send_pattern(&client, i as u64, len).await;
            }
            client.flush().await.unwrap();
            client.stats()
        })
    };
    for (i, &len) in sizes.iter().enumerate() {
        let msg = server.recv().await.unwrap().unwrap();
        assert_eq!(msg[..], pattern(i as u64, len)[..], "message {i}");
    }
    let sent = sender.await.unwrap();
    assert_eq!(sent.inline_sent, 0);
    assert_eq!(sent.eager_sent, 100);
    assert_eq!(sent.rendezvous_sent, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_resolves_every_waiting_future_with_an_error() {
    let addr = format!("{IP}:7704");
    let mut child = tokio::process::Command::new(example("bulk_transfer"))
        .args(["server", &addr, "--device", &common::device()])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pool = test_pool(256 * MIB, ExhaustedPolicy::Wait);
    let cfg = MessageConfig::new().pool(pool.clone()).send_queue_limit(4);
    let ep = retry(1200, || MessageEndpoint::connect_with(addr.as_str(), &cfg)).await;
    signal(&child, "STOP");
    // First an 8 MiB rendezvous the stopped peer never READs, so that no
    // flush can complete; then 64 send+flush futures (7 of 8 eager 4 KiB,
    // 1 of 8 another 8 MiB rendezvous) and 4 recv futures, each on its own
    // clone.
    let mut first = pool.alloc_any(8 * MIB).await.unwrap();
    first.set_len(8 * MIB);
    ep.send(first).await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let ep = ep.clone();
        let len = if i % 8 == 7 { 8 * MIB } else { 4096 };
        tasks.spawn(async move {
            let mut buf = ep.pool().alloc_any(len).await?;
            buf.set_len(len);
            ep.send(buf).await?;
            ep.flush().await
        });
    }
    for _ in 0..4 {
        let ep = ep.clone();
        tasks.spawn(async move { ep.recv().await.map(|_| ()) });
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    if let Some(early) = tasks.try_join_next() {
        panic!("a future finished while the peer is stopped: {early:?}");
    }
    assert_eq!(tasks.len(), 68);
    child.kill().await.unwrap();
    let mut errors = 0;
    let all = async {
        while let Some(r) = tasks.join_next().await {
            let e = r
                .unwrap()
                .expect_err("no future succeeds once the peer died");
            assert!(
                tokio_rdma::Error::from_io(&e).is_some(),
                "typed error: {e:?}"
            );
            errors += 1;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), all)
        .await
        .expect("every waiting future is woken");
    assert_eq!(errors, 64 + 4);
    drop(ep);
    wait_in_use_zero(&pool).await;
}

/// `send_queue_bytes` bounds the bytes queued behind the rendezvous in
/// flight: with the peer stopped (it never READs), 8 rendezvous of 1 MiB go
/// (`max_rendezvous_in_flight`), 3 more queue up to the 3 MiB bound, and
/// the 12th `send` waits; once the peer runs again every send returns and
/// the peer receives all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_waits_while_the_queued_bytes_reach_their_bound() {
    let addr = format!("{IP}:7705");
    let child = tokio::process::Command::new(example("bulk_transfer"))
        .args(["server", &addr, "--device", &common::device()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pool = test_pool(256 * MIB, ExhaustedPolicy::Wait);
    let cfg = MessageConfig::new()
        .pool(pool.clone())
        .send_queue_bytes(3 * MIB as u64);
    let ep = retry(1200, || MessageEndpoint::connect_with(addr.as_str(), &cfg)).await;
    signal(&child, "STOP");
    let returned = Arc::new(AtomicUsize::new(0));
    let sender = {
        let (ep, returned) = (ep.clone(), returned.clone());
        tokio::spawn(async move {
            for _ in 0..20 {
                let mut buf = ep.pool().alloc_any(MIB).await?;
                buf.set_len(MIB);
                ep.send(buf).await?;
                returned.fetch_add(1, Ordering::SeqCst);
            }
            ep.flush().await
        })
    };
    // Up to 60 s for the 11 sends (allocation, window bind, post each, in
    // an emulated guest), then half a second in which the 12th must not
    // return.
    for _ in 0..6000 {
        if returned.load(Ordering::SeqCst) >= 8 + 3 && ep.stats().rendezvous_sent >= 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(returned.load(Ordering::SeqCst), 8 + 3);
    assert_eq!(ep.stats().rendezvous_sent, 8);
    signal(&child, "CONT");
    tokio::time::timeout(Duration::from_secs(120), sender)
        .await
        .expect("the waiting send goes once the queue drains")
        .unwrap()
        .unwrap();
    assert_eq!(returned.load(Ordering::SeqCst), 20);
    ep.close().await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the server ends after the close")
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.contains(&format!("received 20 messages, {} bytes", 20 * MIB)),
        "{out}"
    );
    wait_in_use_zero(&pool).await;
}

// ---- Isolation between peers: memory windows, quotas, agreed limits -------

/// An RDMA READ refused by the peer's NIC: `IBV_WC_REM_ACCESS_ERR` (10).
/// Soft-iWARP reports the responder's TERMINATE (RFC 5040 section 7:
/// its remote access error) by flushing the READ (`IBV_WC_WR_FLUSH_ERR`,
/// 5) on a connection that was up, or by the disconnect that follows.
fn is_remote_access_error(e: &io::Error) -> bool {
    if common::iwarp() {
        // The TERMINATE also disconnects: that event may come first.
        return matches!(
            tokio_rdma::Error::from_io(e),
            Some(tokio_rdma::Error::WorkCompletion {
                op: "RDMA READ",
                status: 5
            }) | Some(tokio_rdma::Error::PeerDisconnected)
        );
    }
    matches!(
        tokio_rdma::Error::from_io(e),
        Some(tokio_rdma::Error::WorkCompletion {
            op: "RDMA READ",
            status: 10
        })
    )
}

async fn accept_pair(
    listener: &MessageListener,
    client: &MessageConfig,
) -> (MessageEndpoint, MessageEndpoint) {
    if std::env::var_os("MSG_TRACE").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .try_init();
    }
    let addr = listener.local_addr().unwrap();
    let (c, s) = tokio::join!(
        MessageEndpoint::connect_with(addr, client),
        listener.accept()
    );
    (c.expect("connect"), s.expect("accept").0)
}

/// Slow READs on the receiving side (4 KiB at a time, 4 WRs deep), so a
/// rendezvous of 64 MiB stays open for seconds.
fn slow_reader() -> MessageConfig {
    MessageConfig::new()
        .max_read_len(4096)
        .connection(tokio_rdma::RdmaConfig::new().send_queue_depth(4))
}

async fn wait_reading(ep: &MessageEndpoint) {
    for _ in 0..3000 {
        if ep.stats().read_wrs > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the rendezvous READs did not start");
}

/// Server S serves clients A, A2 and B. S sends B a 64 MiB secret; while B
/// reads it, A gets an RTS with the key of B's window (and A2 one with the
/// slab's own MR key), both at the secret's address: their READs fail with a
/// remote access error and deliver nothing, and B gets the secret intact.
/// After B's DONE the same key no longer works even on B's own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_key_opens_one_message_to_one_peer_until_done() {
    let pool = test_pool(256 * MIB, ExhaustedPolicy::Wait);
    let s_cfg = MessageConfig::new().pool(pool.clone());
    let listener = MessageListener::bind_with(format!("{IP}:0"), &s_cfg)
        .await
        .unwrap();
    let (a, s_a) = accept_pair(&listener, &MessageConfig::new()).await;
    let (a2, s_a2) = accept_pair(&listener, &MessageConfig::new()).await;
    let (b, s_b) = accept_pair(&listener, &slow_reader()).await;

    let len = 64 * MIB;
    let secret = pattern(77, len);
    // The endpoint's pool: the configured one, or on iWARP the
    // connection's own (on its PD), so the message is sent uncopied.
    let mut buf = s_b.pool().alloc_any(len).await.unwrap();
    buf.spare_mut()[..len].copy_from_slice(&secret);
    buf.set_len(len);
    let (addr, slab_rkey) = (buf.addr(), buf.rkey());
    s_b.send(buf).await.unwrap();
    wait_reading(&b).await;
    let (waddr, wlen, key) = tokio_rdma::__testing::last_window(&s_b).expect("a window");
    assert_eq!(
        (waddr, wlen),
        (addr, len as u64),
        "the window covers exactly the message"
    );
    assert_ne!(key, slab_rkey);

    // B's window key, used through A's connection.
    // 8 KiB: above the 4 KiB eager limit, so it is an RTS the peer READs.
    tokio_rdma::__testing::send_forged_rts(&s_a, 8192, addr, key).unwrap();
    let err = a.recv().await.expect_err("A cannot read B's message");
    assert!(is_remote_access_error(&err), "{err:?}");
    // The slab's own MR key opens nothing either.
    tokio_rdma::__testing::send_forged_rts(&s_a2, 8192, addr, slab_rkey).unwrap();
    let err = a2.recv().await.expect_err("the MR key opens nothing");
    assert!(is_remote_access_error(&err), "{err:?}");
    assert_eq!(a.stats().messages_received, 0);
    assert_eq!(a2.stats().messages_received, 0);

    // B gets the secret, intact.
    let got = b.recv().await.unwrap().expect("the secret");
    assert!(got[..] == secret[..], "B's message intact");
    s_b.flush().await.unwrap();
    // After DONE the window is invalidated: the key is dead on B's own QP.
    tokio_rdma::__testing::send_forged_rts(&s_b, 8192, addr, key).unwrap();
    let err = b.recv().await.expect_err("the key died with the DONE");
    assert!(is_remote_access_error(&err), "{err:?}");
    assert_eq!(b.stats().messages_received, 1);
}

/// A READ past the announced message, through the connection the window
/// was bound for, while it is bound: a remote access error; nothing of the
/// forged announcement is delivered. (rxe checks a window access against
/// its memory region's range, not the window's (rxe_resp.c, check_rkey);
/// hardware NICs check the window's. So the message here has a region of
/// its own, which ends where the message does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_one_byte_past_the_window_fails() {
    let pool = test_pool(256 * MIB, ExhaustedPolicy::Wait);
    let s_cfg = MessageConfig::new().pool(pool.clone());
    let listener = MessageListener::bind_with(format!("{IP}:0"), &s_cfg)
        .await
        .unwrap();
    let (b, s_b) = accept_pair(&listener, &slow_reader()).await;
    let len = 64 * MIB;
    let msg = pattern(78, len);
    let mut buf = s_b.pool().alloc_any(len).await.unwrap();
    buf.spare_mut()[..len].copy_from_slice(&msg);
    buf.set_len(len);
    let addr = buf.addr();
    s_b.send(buf).await.unwrap();
    wait_reading(&b).await;
    eprintln!("one-byte: reading started");
    let (_, _, key) = tokio_rdma::__testing::last_window(&s_b).unwrap();
    // Right after the message, with its window's key (8 KiB: more than
    // goes eagerly, so it is an RTS the reader READs).
    tokio_rdma::__testing::send_forged_rts(&s_b, 8192, addr + len as u64, key).unwrap();
    let mut delivered = 0;
    eprintln!("one-byte: forged RTS queued");
    let err = loop {
        let r = b.recv().await;
        eprintln!(
            "one-byte: recv -> {:?}",
            r.as_ref().map(|m| m.as_ref().map(|m| m.len()))
        );
        match r {
            Ok(Some(m)) => {
                assert!(m[..] == msg[..], "only the real message, intact");
                delivered += 1;
            }
            Ok(None) => panic!("end of stream instead of an error"),
            Err(e) => break e,
        }
    };
    assert!(is_remote_access_error(&err), "{err:?}");
    assert!(delivered <= 1, "the forged byte is never delivered");
}

/// One peer announces far more than its quota while another connection on
/// the same pool runs a ping-pong: the ping-pong keeps completing round
/// trips during the flood, and the flood arrives intact once the receiver
/// reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_peer_is_held_to_its_quota_while_others_go_on() {
    let pool = test_pool(64 * MIB, ExhaustedPolicy::Wait);
    let s_cfg = MessageConfig::new()
        .pool(pool.clone())
        .pool_quota(8 * MIB as u64);
    let listener = MessageListener::bind_with(format!("{IP}:0"), &s_cfg)
        .await
        .unwrap();
    let (flooder, s_f) = accept_pair(&listener, &MessageConfig::new()).await;
    let (pinger, s_p) = accept_pair(&listener, &MessageConfig::new()).await;
    // 6 x 16 MiB = 96 MiB announced to a 64 MiB pool.
    let flood = tokio::spawn(async move {
        for i in 0..6u64 {
            send_pattern(&flooder, 100 + i, 16 * MIB).await;
        }
        flooder.flush().await.unwrap();
        flooder
    });
    for _ in 0..3000 {
        if s_f.stats().quota_stalls > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s_f.stats().quota_stalls, 1, "the flood met the quota");
    let echo = tokio::spawn(async move {
        while let Some(m) = s_p.recv().await.unwrap() {
            s_p.send(m).await.unwrap();
        }
    });
    let mut round_trips = 0;
    for i in 0..200u64 {
        let data = pattern(i, 64);
        pinger.send_copy(&data).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(30), pinger.recv())
            .await
            .expect("the ping-pong is not held up by the flood")
            .unwrap()
            .unwrap();
        assert_eq!(back[..], data[..]);
        round_trips += 1;
    }
    assert_eq!(round_trips, 200);
    assert!(!flood.is_finished(), "the flood is still outstanding");
    assert_eq!(s_f.stats().messages_received, 0);
    assert!(
        s_f.stats().quota_bytes_held <= 17 * MIB as u64,
        "one message over the quota at most: {:?}",
        s_f.stats()
    );
    for i in 0..6u64 {
        let m = s_f.recv().await.unwrap().expect("a flood message");
        assert!(m[..] == pattern(100 + i, 16 * MIB)[..], "flood message {i}");
    }
    let flooder = tokio::time::timeout(Duration::from_secs(60), flood)
        .await
        .expect("the flood completes once read")
        .unwrap();
    drop(flooder);
    drop(pinger);
    echo.await.unwrap();
}

/// Limits that bind both sides are agreed at connect: a client configured
/// for 16 rendezvous in flight against a server's 8 is not aborted when it
/// has 16 outstanding, and a message above the server's `max_message_len`
/// fails locally with `InvalidInput`, leaving the connection usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_agreed_at_connect() {
    let server_cfg = MessageConfig::new();
    let client_cfg = MessageConfig::new()
        .max_rendezvous_in_flight(16)
        .max_message_len(1 << 30);
    let (client, server) = pair(&server_cfg, &client_cfg).await;
    for i in 0..16u64 {
        send_pattern(&client, 200 + i, 64 * 1024).await;
    }
    for i in 0..16u64 {
        let m = server.recv().await.unwrap().expect("a message");
        assert!(m[..] == pattern(200 + i, 64 * 1024)[..], "message {i}");
    }
    client.flush().await.unwrap();
    let big = client
        .pool()
        .register_vec(vec![7u8; (128 << 20) + 1])
        .unwrap();
    let err = client.send(big).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    send_pattern(&client, 300, 4096).await;
    let m = server.recv().await.unwrap().unwrap();
    assert!(m[..] == pattern(300, 4096)[..]);
}

/// Keepalive probes on an idle message endpoint (1 s here) are acknowledged
/// and consume nothing: afterwards messages flow as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_probes_keep_an_idle_endpoint_intact() {
    let cfg = MessageConfig::new()
        .connection(tokio_rdma::RdmaConfig::new().keepalive(Some(Duration::from_secs(1))));
    let (client, server) = pair(&cfg, &cfg).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    send_pattern(&client, 400, 4096).await;
    send_pattern(&client, 401, 1 << 20).await;
    let m = server.recv().await.unwrap().unwrap();
    assert!(m[..] == pattern(400, 4096)[..]);
    let m = server.recv().await.unwrap().unwrap();
    assert!(m[..] == pattern(401, 1 << 20)[..]);
    assert_eq!(server.stats().messages_received, 2);
    assert_eq!(client.stats().messages_sent, 2);
}

/// An endpoint posts 15 receive buffers at first and doubles them each
/// time its peer is about to run out of credit: a receiver that does not
/// take 300 messages for a while ends with `recv_queue_depth` (128) posted,
/// and every message arrives intact and in order once it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_buffers_grow_from_15_to_the_queue_depth_under_load() {
    const COUNT: u64 = 300;
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    assert_eq!(server.stats().recv_buffers_posted, 15);
    assert_eq!(client.stats().recv_buffers_posted, 15);
    let sender = tokio::spawn(async move {
        for i in 0..COUNT {
            send_pattern(&client, 500 + i, 64).await;
        }
        client.flush().await.unwrap();
        client
    });
    // Not taking anything: the sender fills every slot the receiver posts.
    let start = std::time::Instant::now();
    while server.stats().recv_buffers_posted < 128 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{:?}",
            server.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..COUNT {
        let m = server.recv().await.unwrap().unwrap();
        assert!(m[..] == pattern(500 + i, 64)[..], "message {i}");
    }
    let client = sender.await.unwrap();
    assert_eq!(server.stats().recv_buffers_posted, 128);
    assert_eq!(server.stats().messages_received, COUNT);
    assert_eq!(client.stats().messages_sent, COUNT);
}

/// An abort while eager SENDs are posted: the aborted messages' buffers
/// stay held until the NIC is done with them (their WR's completion or
/// flush, or the QP's destruction), so the pool cannot hand one out again
/// for other data that the NIC would then send to the aborting peer.
///
/// What rxe does: its requester copies a SEND's payload into the packet
/// when it runs the WR (inside `ibv_post_send` or in its worker right
/// after), so on rxe the peer shows no leaked bytes even without the rule.
/// So the test checks the rule itself, exactly: the last batch is posted
/// by the `Sink`'s flush and no completion is polled before `abort` on
/// this current-thread runtime, so its SENDs are still in the ledger, and
/// the pool must neither count their buffers free nor hand the last one
/// out again. Before the ledger, `abort` freed them at once and the first
/// allocation after it returned the last message's buffer.
#[tokio::test]
async fn abort_keeps_posted_send_buffers_until_the_nic_is_done() {
    use futures::SinkExt as _;
    // Eager (eager_max 4096, 4092 on iWARP), above the inline threshold.
    const LEN: usize = 4000;
    const N: u64 = 8; // below the peer's first receive credit
    for round in 0..10u64 {
        let client_pool = MemoryPool::for_device(&common::device(), PoolConfig::new()).unwrap();
        let client_cfg = MessageConfig::new().pool(client_pool.clone());
        let (mut client, server) = pair(&MessageConfig::new(), &client_cfg).await;
        // The configured pool, or on iWARP the connection's own.
        let client_pool = client.pool().clone();
        let in_use_before = client_pool.stats().bytes_in_use;
        let mut last_addr = 0;
        for i in 0..N {
            let seed = round * 100 + i;
            let mut buf = client_pool.alloc_any(LEN).await.unwrap();
            buf.spare_mut()[..LEN].copy_from_slice(&pattern(seed, LEN));
            buf.set_len(LEN);
            last_addr = buf.addr();
            client.feed(buf).await.expect("queued");
        }
        // Posted (one doorbell), not known complete: nothing polls the CQ
        // before the abort on this thread.
        futures::SinkExt::<tokio_rdma::PoolBuf>::flush(&mut client)
            .await
            .expect("posted");
        client.abort();
        let held = client.stats().buffers_held_for_nic;
        assert!(
            (1..=N).contains(&held),
            "round {round}: the last batch's SENDs are held for the NIC, got {held}"
        );
        let class = client_pool.class_size(LEN).unwrap() as u64;
        assert_eq!(
            client_pool.stats().bytes_in_use,
            in_use_before + held * class,
            "round {round}: held buffers are not back in the pool"
        );
        // Reuse at once with another pattern: the pool must not hand out
        // the buffer the last SEND still names.
        let mut reused = Vec::new();
        for _ in 0..2 * N {
            let mut b = client_pool.try_alloc_any(LEN).expect("pool memory");
            b.spare_mut()[..LEN].fill(0xEE);
            b.set_len(LEN);
            assert_ne!(
                b.addr(),
                last_addr,
                "round {round}: a buffer a posted SEND names was handed out again"
            );
            reused.push(b);
        }
        // The peer gets exact messages, then the abort.
        let mut got = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(20), server.recv())
                .await
                .expect("the abort reaches the peer in time")
            {
                Ok(Some(msg)) => {
                    assert_eq!(msg.len(), LEN);
                    assert!(
                        msg[..] == pattern(round * 100 + got, LEN)[..],
                        "round {round}: message {got} is the sender's bytes"
                    );
                    got += 1;
                }
                Ok(None) => panic!("round {round}: an abort is not a clean close"),
                Err(e) => {
                    assert!(is_kind(&e, io::ErrorKind::ConnectionReset), "{e}");
                    break;
                }
            }
        }
        assert!(got <= N);
        drop(reused);
        drop(client);
        drop(server);
        // The QP is destroyed before the ledger lets its buffers go: every
        // buffer is back.
        wait_in_use_zero(&client_pool).await;
    }
}

/// Endpoints, listener and pool dropped in each of the six orders while
/// 64 eager sends (most queued behind credit), 4 rendezvous (the peer's
/// RDMA READs in flight) and 4 receives are outstanding: no crash, no
/// hang, and every verbs resource (QPs, CQs, MRs, windows, cm ids) and
/// file descriptor back at the start. Whatever a WR still names stays with
/// its QP's ledger until the QP is destroyed, so the pool's slabs are
/// deregistered only after the last QP that used them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_endpoints_listener_and_pool_in_any_order_with_work_in_flight() {
    use futures::SinkExt as _;
    let orders: [[usize; 3]; 6] = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for order in orders {
        let start = tokio_rdma::stats::resources();
        let fds = common::open_fds();
        let pool = MemoryPool::for_device(&common::device(), PoolConfig::new()).unwrap();
        let cfg = MessageConfig::new().pool(pool.clone());
        let listener = MessageListener::bind_with(format!("{IP}:0"), &cfg)
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (c, s) = tokio::join!(MessageEndpoint::connect_with(addr, &cfg), listener.accept());
        let (mut client, server) = (c.unwrap(), s.unwrap().0);
        // The server's receives, in flight as tasks.
        let server = Arc::new(server);
        let mut receivers = Vec::new();
        for _ in 0..4 {
            let s = Arc::clone(&server);
            receivers.push(tokio::spawn(async move {
                s.recv().await.map(|m| m.map(|m| m.len()))
            }));
        }
        for i in 0..64u64 {
            let mut b = pool.alloc_any(4096).await.unwrap();
            b.spare_mut()[..4096].copy_from_slice(&pattern(i, 4096));
            b.set_len(4096);
            client.feed(b).await.unwrap();
        }
        futures::SinkExt::<tokio_rdma::PoolBuf>::flush(&mut client)
            .await
            .unwrap();
        for i in 0..4u64 {
            send_pattern(&client, 100 + i, 4 * MIB).await;
        }
        let mut endpoints = Some((client, server, receivers));
        let mut listener = Some(listener);
        let mut pool = Some((pool, cfg));
        for what in order {
            match what {
                0 => {
                    let (c, s, r) = endpoints.take().unwrap();
                    drop(c);
                    drop(s);
                    for t in r {
                        t.abort();
                    }
                }
                1 => drop(listener.take()),
                _ => drop(pool.take()),
            }
        }
        common::assert_back_to(start, fds, 2, Duration::from_secs(60)).await;
    }
}
