//! A tiny gRPC "greeter" service written by hand against tonic's
//! `server::Grpc`/`client::Grpc`, with a raw-bytes codec instead of protobuf
//! (no protoc, no build script). Shared by the transport test suite and
//! `examples/tonic_greeter.rs`.
//!
//! Methods (service `greeter.Greeter`):
//! - `SayHello` (unary): a name in, `"Hello, {name} over {transport} from
//!   {peer ip}"` out, from the server's view of the connection.
//! - `Count` (server streaming): a big-endian `u32` n in, n messages
//!   `"0"`, `"1"`, ... `"{n-1}"` out.
//! - `Echo` (bidirectional streaming): every message comes back unchanged,
//!   in order.
#![allow(dead_code)]

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use http::uri::PathAndQuery;
use tokio_rdma::transport::ConnectionInfo;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder, Streaming};
use tonic::server::{NamedService, ServerStreamingService, StreamingService, UnaryService};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Messages are raw bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

const SAY_HELLO: &str = "/greeter.Greeter/SayHello";
const COUNT: &str = "/greeter.Greeter/Count";
const ECHO: &str = "/greeter.Greeter/Echo";

type MsgStream = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

/// The server side: add it with `Server::builder().add_service(GreeterServer)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GreeterServer;

impl NamedService for GreeterServer {
    const NAME: &'static str = "greeter.Greeter";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for GreeterServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(RawCodec);
            Ok(match req.uri().path() {
                SAY_HELLO => grpc.unary(SayHello, req).await,
                COUNT => grpc.server_streaming(Count, req).await,
                ECHO => grpc.streaming(Echo, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct SayHello;

impl UnaryService<Bytes> for SayHello {
    type Response = Bytes;
    type Future = BoxFuture<'static, Result<Response<Bytes>, Status>>;

    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        let info = req.extensions().get::<ConnectionInfo>().copied();
        let name = req.into_inner();
        Box::pin(async move {
            let info = info.ok_or_else(|| Status::internal("no ConnectionInfo extension"))?;
            Ok(Response::new(Bytes::from(format!(
                "Hello, {} over {} from {}",
                String::from_utf8_lossy(&name),
                info.transport,
                info.peer.ip()
            ))))
        })
    }
}

struct Count;

impl ServerStreamingService<Bytes> for Count {
    type Response = Bytes;
    type ResponseStream = MsgStream;
    type Future = BoxFuture<'static, Result<Response<MsgStream>, Status>>;

    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        let msg = req.into_inner();
        Box::pin(async move {
            let n: [u8; 4] = msg[..]
                .try_into()
                .map_err(|_| Status::invalid_argument("Count takes a big-endian u32"))?;
            let n = u32::from_be_bytes(n);
            let s = futures::stream::iter((0..n).map(|i| Ok(Bytes::from(i.to_string()))));
            Ok(Response::new(Box::pin(s) as MsgStream))
        })
    }
}

struct Echo;

impl StreamingService<Bytes> for Echo {
    type Response = Bytes;
    type ResponseStream = MsgStream;
    type Future = BoxFuture<'static, Result<Response<MsgStream>, Status>>;

    fn call(&mut self, req: Request<Streaming<Bytes>>) -> Self::Future {
        let inbound = req.into_inner();
        Box::pin(async move { Ok(Response::new(Box::pin(inbound) as MsgStream)) })
    }
}

/// The client side, over any tonic [`Channel`].
#[derive(Debug, Clone)]
pub struct GreeterClient {
    inner: tonic::client::Grpc<Channel>,
}

impl GreeterClient {
    /// A client on `channel`.
    pub fn new(channel: Channel) -> Self {
        GreeterClient {
            inner: tonic::client::Grpc::new(channel),
        }
    }

    async fn ready(&mut self) -> Result<(), Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))
    }

    /// `SayHello`: the server's greeting.
    pub async fn say_hello(&mut self, name: &str) -> Result<String, Status> {
        self.ready().await?;
        let res = self
            .inner
            .unary(
                Request::new(Bytes::copy_from_slice(name.as_bytes())),
                PathAndQuery::from_static(SAY_HELLO),
                RawCodec,
            )
            .await?;
        String::from_utf8(res.into_inner().to_vec()).map_err(|_| Status::data_loss("not UTF-8"))
    }

    /// `Count`: the stream of `n` numbers.
    pub async fn count(&mut self, n: u32) -> Result<Streaming<Bytes>, Status> {
        self.ready().await?;
        let res = self
            .inner
            .server_streaming(
                Request::new(Bytes::copy_from_slice(&n.to_be_bytes())),
                PathAndQuery::from_static(COUNT),
                RawCodec,
            )
            .await?;
        Ok(res.into_inner())
    }

    /// `Echo`: every message of `outbound` comes back.
    pub async fn echo(
        &mut self,
        outbound: impl Stream<Item = Bytes> + Send + 'static,
    ) -> Result<Streaming<Bytes>, Status> {
        self.ready().await?;
        let res = self
            .inner
            .streaming(
                Request::new(outbound.boxed()),
                PathAndQuery::from_static(ECHO),
                RawCodec,
            )
            .await?;
        Ok(res.into_inner())
    }
}
