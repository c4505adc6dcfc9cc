//! Prompt KV on a direct TCP connection from a prefill worker to a decode worker, beside NATS
//! (which keeps the grants, drops, failures and heartbeats; see [`llmq_protocol::prefill`]).
//!
//! The decode worker listens (`worker.kv_listen`, loopback by default: the prefill workers of
//! `llmq up` on the same host) and offers its address (`worker.kv_advertise`, or the bound
//! one, or for a wildcard its own address toward NATS) and a token of its own in every grant.
//! A prefill worker connects once per decoder and writes each chunk as a [`KvFrame`] and its
//! bytes; where it cannot connect or write, it sends that chunk as NATS pieces, and tries the
//! connection again after `RETRY_AFTER`. The decoder drops a connection whose frame is
//! malformed or carries another token.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use llmq_protocol::prefill::{check_kv, DirectKv, KvError, KvFrame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::UnboundedSender;

/// A connection that failed is not tried again for this long (its chunks go as NATS pieces).
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// The largest chunk a decoder takes (a 4,096-token chunk of a 70B model in bf16 is 1.3 GB).
const MAX_CHUNK_BYTES: u64 = 8 << 30;

/// How long a prefill worker waits for a decoder's connection to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What a decode worker's connections deliver, in order for each chunk.
#[derive(Debug)]
pub enum Received {
    /// A chunk's frame: the chunk is computed, its bytes follow.
    Frame(KvFrame),
    /// The chunk's bytes, and whether they are the size and checksum the frame announced
    /// (checked on a blocking thread: the checksum of a large chunk takes tens of ms, which the
    /// worker's runtime thread, where token events go out, does not wait for).
    Bytes(KvFrame, Vec<u8>, Result<(), KvError>),
}

/// Where a decode worker listens and what its grants offer.
pub struct Listen<'a> {
    /// `host:port` to bind (port 0: any).
    pub addr: &'a str,
    /// The host offered instead of the bound address.
    pub advertise: Option<&'a str>,
    /// The NATS server's URL: for a wildcard address, the offer is this host's address toward it.
    pub nats_url: &'a str,
    /// Refuse to listen beyond the loopback (the connection is not encrypted; NATS is).
    pub loopback_only: bool,
}

/// Listens as `at` says and delivers every connection's frames to `to`; returns the offer
/// grants carry. Must run inside the worker's runtime.
pub async fn listen(at: Listen<'_>, to: UnboundedSender<Received>) -> std::io::Result<DirectKv> {
    let listener = TcpListener::bind(at.addr).await?;
    let local = listener.local_addr()?;
    if at.loopback_only && !local.ip().is_loopback() {
        let why = format!("{local} is beyond the loopback, and NATS is on TLS while this connection is not encrypted");
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            why,
        ));
    }
    let offer = offered(local, at.advertise, at.nats_url).await?;
    // A secret of this process (std's hasher keys are random per process).
    let token = std::hash::BuildHasher::hash_one(
        &std::collections::hash_map::RandomState::new(),
        (local, std::process::id()),
    );
    actix::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    let to = to.clone();
                    actix::spawn(async move {
                        if let Err(e) = read_frames(stream, token, &to).await {
                            tracing::warn!(%peer, error = %e, "a direct KV connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a direct KV connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok(DirectKv { addr: offer, token })
}

/// The `host:port` grants offer for a listener bound at `local`: the advertised host, else the
/// bound address, else (a wildcard) this host's address toward the NATS server; the bound port.
async fn offered(
    local: SocketAddr,
    advertise: Option<&str>,
    nats_url: &str,
) -> std::io::Result<String> {
    let ip = match advertise {
        Some(host) => match host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(ip) => ip,
            Err(_) => return Ok(format!("{host}:{}", local.port())),
        },
        None if local.ip().is_unspecified() => toward(nats_url).await?,
        None => local.ip(),
    };
    Ok(SocketAddr::new(ip, local.port()).to_string())
}

/// This host's address on its route to the first server of a NATS URL
/// (`[scheme://][user:pass@]host[:port]`, port 4222 by default): a UDP socket is connected to
/// it, which sends nothing, and asked for its own address.
async fn toward(nats_url: &str) -> std::io::Result<IpAddr> {
    let first = nats_url.split(',').next().unwrap_or_default().trim();
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let host = rest
        .rsplit_once('@')
        .map_or(rest, |(_, h)| h)
        .trim_end_matches('/');
    let has_port = host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok());
    let target = if has_port {
        host.to_string()
    } else {
        format!("{host}:4222")
    };
    let server = tokio::net::lookup_host(&target)
        .await?
        .next()
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{target} resolves to no address"),
            )
        })?;
    let socket = tokio::net::UdpSocket::bind(if server.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })
    .await?;
    socket.connect(server).await?;
    Ok(socket.local_addr()?.ip())
}

/// Reads frames and their bytes until the connection closes (Ok) or misbehaves (Err).
async fn read_frames(
    mut stream: TcpStream,
    token: u64,
    to: &UnboundedSender<Received>,
) -> std::io::Result<()> {
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    stream.set_nodelay(true)?;
    loop {
        let mut prefix = [0u8; 4];
        match stream.read_exact(&mut prefix).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let n = KvFrame::length(prefix)
            .ok_or_else(|| bad("a frame of a length no frame has".into()))?;
        let mut body = vec![0u8; n];
        stream.read_exact(&mut body).await?;
        let frame: KvFrame =
            llmq_protocol::decode(&body).map_err(|e| bad(format!("an undecodable frame: {e}")))?;
        if frame.token != token {
            return Err(bad("a frame with another token".into()));
        }
        if frame.total_bytes > MAX_CHUNK_BYTES {
            return Err(bad(format!("a chunk of {} bytes", frame.total_bytes)));
        }
        let _ = to.send(Received::Frame(frame.clone()));
        let mut bytes = vec![0u8; frame.total_bytes as usize];
        stream.read_exact(&mut bytes).await?;
        let checked = tokio::task::spawn_blocking(move || {
            let checked = check_kv(&bytes, frame.total_bytes, frame.checksum);
            (frame, bytes, checked)
        })
        .await;
        let (frame, bytes, checked) = checked.map_err(|e| bad(format!("checking a chunk: {e}")))?;
        let _ = to.send(Received::Bytes(frame, bytes, checked));
    }
}

/// A prefill worker's connections to its decoders, by address.
#[derive(Default)]
pub struct Connections {
    open: HashMap<String, TcpStream>,
    failed: HashMap<String, Instant>,
}

impl Connections {
    /// Sends a chunk to `to` as `frame` and `bytes`; false where the connection could not be
    /// opened or written (the caller sends NATS pieces instead).
    pub async fn send(&mut self, to: &DirectKv, frame: &KvFrame, bytes: &[u8]) -> bool {
        if self
            .failed
            .get(&to.addr)
            .is_some_and(|t| t.elapsed() < RETRY_AFTER)
        {
            return false;
        }
        let result = async {
            if !self.open.contains_key(&to.addr) {
                let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&to.addr))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "connecting")
                    })??;
                stream.set_nodelay(true)?;
                self.open.insert(to.addr.clone(), stream);
            }
            let stream = self.open.get_mut(&to.addr).expect("opened above");
            let head = frame.encode().map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
            })?;
            stream.write_all(&head).await?;
            stream.flush().await?;
            stream.write_all(bytes).await?;
            stream.flush().await
        }
        .await;
        match result {
            Ok(()) => {
                self.failed.remove(&to.addr);
                true
            }
            Err(e) => {
                tracing::warn!(decoder = %to.addr, error = %e, "direct KV connection failed; sending over NATS");
                self.open.remove(&to.addr);
                self.failed.insert(to.addr.clone(), Instant::now());
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::unbounded_channel;

    #[test]
    fn chunks_arrive_frame_then_checked_bytes_and_a_foreign_token_is_turned_away() {
        actix::System::new().block_on(async {
            let (tx, mut rx) = unbounded_channel();
            let at = Listen { addr: "127.0.0.1:0", advertise: None, nats_url: "nats://127.0.0.1:4222", loopback_only: true };
            let offer = listen(at, tx).await.unwrap();
            let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            let checksum = llmq_protocol::prefill::kv_checksum(&bytes);
            let frame = KvFrame { token: offer.token, key: 4, start: 32, n: 16, total_bytes: bytes.len() as u64, checksum, sent_at_us: 2 };
            let mut conns = Connections::default();
            assert!(conns.send(&offer, &frame, &bytes).await);
            assert!(conns.send(&offer, &KvFrame { start: 48, ..frame.clone() }, &bytes).await, "the connection is kept");
            assert!(conns.send(&offer, &KvFrame { start: 64, checksum: checksum ^ 1, ..frame.clone() }, &bytes).await);
            for start in [32, 48, 64] {
                assert!(matches!(rx.recv().await, Some(Received::Frame(f)) if f.start == start));
                let checked = if start == 64 { Err(KvError::Checksum) } else { Ok(()) };
                assert!(matches!(rx.recv().await, Some(Received::Bytes(f, b, c)) if f.start == start && b == bytes && c == checked));
            }
            // Another token: the decoder drops the connection and delivers nothing.
            let stranger = DirectKv { token: offer.token ^ 1, ..offer.clone() };
            let mut other = Connections::default();
            other.send(&stranger, &KvFrame { token: stranger.token, ..frame.clone() }, &bytes).await;
            let nothing = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
            assert!(nothing.is_err(), "nothing delivered: {nothing:?}");
            // Nobody listening: the sender says so (its caller sends over NATS) and waits before trying again.
            let gone = DirectKv { addr: "127.0.0.1:1".into(), token: 0 };
            assert!(!other.send(&gone, &frame, &bytes).await);
            assert!(other.failed.contains_key(&gone.addr));
        });
    }

    #[test]
    fn the_offer_names_an_address_prefill_workers_can_reach() {
        actix::System::new().block_on(async {
            let loopback: SocketAddr = "127.0.0.1:7001".parse().unwrap();
            let wildcard: SocketAddr = "0.0.0.0:7001".parse().unwrap();
            assert_eq!(
                offered(loopback, None, "unused").await.unwrap(),
                "127.0.0.1:7001"
            );
            assert_eq!(
                offered(wildcard, Some("worker-3"), "unused").await.unwrap(),
                "worker-3:7001"
            );
            assert_eq!(
                offered(wildcard, Some("::1"), "unused").await.unwrap(),
                "[::1]:7001"
            );
            // A wildcard: this host's address toward the NATS server, whatever the URL's form.
            for url in [
                "nats://127.0.0.1:4222",
                "tls://user:secret@127.0.0.1",
                "127.0.0.1,nats://10.0.0.9:4222",
            ] {
                assert_eq!(
                    offered(wildcard, None, url).await.unwrap(),
                    "127.0.0.1:7001",
                    "{url}"
                );
            }
            assert!(offered(wildcard, None, "nats://no-such-host.invalid:4222")
                .await
                .is_err());
            // Beyond the loopback while NATS is on TLS: refused, never a plaintext listener.
            let (tx, _rx) = unbounded_channel();
            let at = Listen {
                addr: "0.0.0.0:0",
                advertise: None,
                nats_url: "tls://127.0.0.1:4222",
                loopback_only: true,
            };
            let refused = listen(at, tx).await.unwrap_err();
            assert_eq!(refused.kind(), std::io::ErrorKind::PermissionDenied);
        });
    }
}
