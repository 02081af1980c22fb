//! The stream echo loop shared by `examples/echo.rs` and the guest tests
//! (`tests/common`).

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Echoes everything `s` reads until EOF, then half-closes; returns the
/// bytes echoed.
pub async fn echo(mut s: tokio_rdma::RdmaStream) -> std::io::Result<u64> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            s.shutdown().await?;
            return Ok(total);
        }
        s.write_all(&buf[..n]).await?;
        total += n as u64;
    }
}
