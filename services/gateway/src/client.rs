//! A minimal HTTP/1.1 client for the gateway's own tests and benchmark: one request per
//! connection (`Connection: close`), bodies by length or chunked, and server-sent events handed
//! over line by line as they arrive. Not a general client: no TLS, no redirects, no keep-alive.

use std::io;
use std::time::Instant;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct Response {
    pub status: u16,
    pub body: String,
}

fn bad(m: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m.into())
}

/// Sends a request; returns the status, the response's headers (lower-cased names) and the
/// reader positioned at the body.
async fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    extra: &[(&str, &str)],
) -> io::Result<(u16, Vec<(String, String)>, BufReader<TcpStream>)> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let body = body.unwrap_or("");
    let extra: String = extra.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(format!("status line {line:?}")))?;
    let mut headers = vec![];
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Err(bad("connection closed in the headers"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers, r))
}

/// Reads the body, calling `piece` with each part as it arrives (each chunk of a chunked body).
async fn read_body(
    headers: &[(String, String)],
    r: &mut BufReader<TcpStream>,
    mut piece: impl FnMut(&[u8]),
) -> io::Result<()> {
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut line = String::new();
        loop {
            line.clear();
            r.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad(format!("chunk size {line:?}")))?;
            let mut buf = vec![0; size + 2];
            r.read_exact(&mut buf).await?;
            if size == 0 {
                return Ok(());
            }
            piece(&buf[..size]);
        }
    } else if let Some(n) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        let mut buf = vec![0; n];
        r.read_exact(&mut buf).await?;
        piece(&buf);
        Ok(())
    } else {
        let mut buf = vec![];
        r.read_to_end(&mut buf).await?;
        piece(&buf);
        Ok(())
    }
}

/// One request, the whole response.
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> io::Result<Response> {
    request_with(addr, method, path, body, &[]).await
}

/// One request with extra headers (`Authorization`, say), the whole response.
pub async fn request_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> io::Result<Response> {
    let (status, headers, mut r) = send(addr, method, path, body, headers).await?;
    let mut out = vec![];
    read_body(&headers, &mut r, |p| out.extend_from_slice(p)).await?;
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&out).into_owned(),
    })
}

/// A streaming request: `line` gets every non-empty line of the event stream (`data: ...`,
/// `: comment`) with the time its chunk arrived. Returns the status (a non-2xx response's body
/// is handed to `line` whole).
pub async fn stream(
    addr: &str,
    path: &str,
    body: &str,
    mut line: impl FnMut(Instant, &str),
) -> io::Result<u16> {
    let (status, headers, mut r) = send(addr, "POST", path, Some(body), &[]).await?;
    let mut pending = String::new();
    read_body(&headers, &mut r, |p| {
        let at = Instant::now();
        pending.push_str(&String::from_utf8_lossy(p));
        while let Some(i) = pending.find('\n') {
            let l: String = pending.drain(..=i).collect();
            let l = l.trim_end();
            if !l.is_empty() {
                line(at, l);
            }
        }
    })
    .await?;
    if !pending.trim().is_empty() {
        line(Instant::now(), pending.trim());
    }
    Ok(status)
}
