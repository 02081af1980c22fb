//! Guest tests of the zero-copy message endpoint on rxe0 (needs the
//! Soft-RoCE guest: `integration/softroce run -- ...`). Fails, never skips,
//! without a device.

use std::io;
use std::time::Duration;

use tokio_rdma::pool::{ExhaustedPolicy, MemoryPool, PoolConfig};
use tokio_rdma::proto::message::MessageStats;
use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener, PoolBytes};

const IP: &str = "10.11.0.1";
const MIB: usize = 1024 * 1024;

/// Deterministic content: byte `i` of message `seed` (xorshift-free, cheap).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761) ^ seed.wrapping_mul(0x9E37_79B9)) as u8)
        .collect()
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
        .expect("bind on rxe0's address");
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
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    let sizes = [0, 1, 4096, 4097, MIB, 64 * MIB];
    let sender = tokio::spawn(async move {
        for (i, &len) in sizes.iter().enumerate() {
            send_pattern(&client, i as u64, len).await;
        }
        client.flush().await.expect("flush");
        client
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
    let client = sender.await.unwrap();
    let sent: MessageStats = client.stats();
    assert_eq!(sent.messages_sent, 6);
    // 0, 1 and 4096 bytes go eagerly (eager_max 4096); the rest by
    // rendezvous.
    assert_eq!(sent.eager_sent, 3);
    assert_eq!(sent.rendezvous_sent, 3);
    let got = server.stats();
    assert_eq!(got.messages_received, 6);
    assert_eq!(got.bytes_received, sizes.iter().sum::<usize>() as u64);
    assert_eq!(got.read_bytes, (4097 + MIB + 64 * MIB) as u64);
    drop(client);
    // The peer closed after everything arrived: end of stream.
    let end = tokio::time::timeout(Duration::from_secs(20), server.recv())
        .await
        .expect("end of stream in time");
    assert!(matches!(end, Ok(None)), "clean end, got {end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_send_posts_the_pool_buffer_itself() {
    let cfg = MessageConfig::new();
    let (client, server) = pair(&cfg, &cfg).await;
    let len = 3000; // above the inline threshold, below eager_max
    let addr = send_pattern(&client, 7, len).await;
    let msg = server.recv().await.unwrap().unwrap();
    assert_eq!(msg[..], pattern(7, len)[..]);
    let sge = client.last_posted_sge().expect("a SEND with an SGE");
    assert_eq!(sge.addr, addr, "the SEND's SGE is the buffer: no copy");
    assert_eq!(sge.len, len as u32);
    // A rendezvous: the receiver's READ lands in the delivered buffer.
    let big = 2 * MIB;
    send_pattern(&client, 8, big).await;
    let msg = server.recv().await.unwrap().unwrap();
    assert_eq!(msg[..], pattern(8, big)[..]);
    let read = server.last_posted_sge().expect("a READ");
    let start = msg.as_ptr() as u64;
    assert!(
        read.addr >= start && read.addr + u64::from(read.len) == start + big as u64,
        "the last READ wrote the tail of the delivered buffer"
    );
}

fn is_kind(e: &io::Error, kind: io::ErrorKind) -> bool {
    e.kind() == kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_announcement_is_a_clear_error_on_both_sides() {
    let server_cfg = MessageConfig::new().max_message_len(MIB as u64);
    let client_cfg = MessageConfig::new();
    let (client, server) = pair(&server_cfg, &client_cfg).await;
    let baseline = server.pool().stats().bytes_in_use;
    send_pattern(&client, 1, 2 * MIB).await;
    let err = server.recv().await.expect_err("oversized message refused");
    assert!(is_kind(&err, io::ErrorKind::InvalidData), "{err}");
    assert!(
        err.to_string().contains("RTS announces 2097152 bytes"),
        "{err}"
    );
    let err = client.flush().await.expect_err("the sender learns of it");
    assert!(is_kind(&err, io::ErrorKind::ConnectionReset), "{err}");
    assert!(err.to_string().contains("code 5"), "{err}");
    // Nothing was allocated for it.
    assert!(server.pool().stats().bytes_in_use <= baseline);
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
    assert!(is_kind(&err, io::ErrorKind::InvalidData), "{err}");
    assert!(err.to_string().contains("remote access"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_receiver_pool_with_error_policy_aborts_and_frees_everything() {
    let small = MemoryPool::for_device(
        "rxe0",
        PoolConfig::new()
            .max_registered_bytes(4 * MIB as u64)
            .exhausted_policy(ExhaustedPolicy::Error),
    )
    .unwrap();
    let server_cfg = MessageConfig::new().pool(small.clone());
    let (client, server) = pair(&server_cfg, &MessageConfig::new()).await;
    let before = small.stats();
    // 8 MiB cannot fit a 4 MiB pool.
    send_pattern(&client, 3, 8 * MIB).await;
    let err = server.recv().await.expect_err("no memory for it");
    assert!(is_kind(&err, io::ErrorKind::OutOfMemory), "{err}");
    let err = client.flush().await.expect_err("sender sees the abort");
    assert!(is_kind(&err, io::ErrorKind::ConnectionReset), "{err}");
    assert_eq!(
        before.bytes_in_use,
        128 * 4096,
        "the posted receive buffers"
    );
    drop(server);
    drop(client);
    for _ in 0..100 {
        if small.stats().bytes_in_use == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        small.stats().bytes_in_use,
        0,
        "every buffer back in the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_receiver_pool_with_wait_policy_waits_for_the_application() {
    let small = MemoryPool::for_device(
        "rxe0",
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
