//! The one HTTP/1.1 client of `bmqctl`, the tests and the brokers (a follower forwards an admin
//! change to the leader, [`forward`]): a request without a body to a node's admin port
//! (`/status`, `/readyz`, `/metrics`, `/admin/...`), `Connection: close`, bodies read up to
//! [`RESPONSE_MAX_BYTES`], `Content-Length`, chunked and read-to-close bodies handled.

use anyhow::{anyhow, bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response body read, bytes (a `/status` of a large cluster, or `/metrics`).
pub const RESPONSE_MAX_BYTES: usize = 16 * 1024 * 1024;

/// One HTTP/1.1 GET with `Connection: close`; returns the body of a 200 response.
///
/// Errors: the connection fails, the response is malformed or larger than
/// [`RESPONSE_MAX_BYTES`], or its status is not 200 (the error quotes the body).
pub async fn get(addr: &str, path: &str) -> anyhow::Result<Vec<u8>> {
    exchange(addr, "GET", path, None).await
}

/// One HTTP/1.1 POST without a body, with `Authorization: Bearer <token>` when `token` is
/// given; returns the body of a 200 response as text.
///
/// Errors: as [`get`]; a 401 names the missing or invalid token.
pub async fn post(addr: &str, path: &str, token: Option<&str>) -> anyhow::Result<String> {
    let body = exchange(addr, "POST", path, token).await?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// One HTTP/1.1 request without a body (`method` is `POST`, `DELETE`, ...), as [`post`].
///
/// Errors: as [`post`].
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<String> {
    let body = exchange(addr, method, path, token).await?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Redirects [`exchange`] follows.
const REDIRECTS_MAX: usize = 4;

/// A `307 Temporary Redirect` to `Location` (e.g. a purge sent to a node that is not the
/// queue's primary): followed by [`exchange`], up to [`REDIRECTS_MAX`] times.
#[derive(Debug)]
struct Redirect(String);

impl std::fmt::Display for Redirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "redirected to {}", self.0)
    }
}

impl std::error::Error for Redirect {}

async fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<Vec<u8>> {
    // A few redirects: a follower sends a membership change to the leader, and a leader asked
    // to remove itself cedes and sends it on to the next one.
    let (mut addr, mut path) = (addr.to_string(), path.to_string());
    for _ in 0..REDIRECTS_MAX {
        match exchange_once(&addr, method, &path, token).await {
            Err(e) => match e.downcast_ref::<Redirect>() {
                Some(Redirect(location)) => {
                    let rest = location
                        .strip_prefix("http://")
                        .ok_or_else(|| anyhow!("unsupported redirect to {location:?}"))?;
                    let (to, next) = match rest.find('/') {
                        Some(i) => (&rest[..i], &rest[i..]),
                        None => (rest, "/"),
                    };
                    (addr, path) = (to.to_string(), next.to_string());
                }
                None => return Err(e),
            },
            ok => return ok,
        }
    }
    bail!("more than {REDIRECTS_MAX} redirects, the last to {addr}{path}")
}

/// One HTTP/1.1 request without a body, as [`request`], without following redirects:
/// returns the status code and the body whatever the status (an admin action that answers a
/// document with its refusal, e.g. `POST /admin/reload`).
///
/// Errors: the connection fails, or the response is malformed or too large.
pub async fn request_with_status(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<(u16, Vec<u8>)> {
    let response = send_and_read(addr, method, path, token).await?;
    let (code, _reason, body) = parse_http_parts(&response)?;
    let code = code
        .parse()
        .with_context(|| format!("malformed HTTP status {code:?}"))?;
    Ok((code, body))
}

/// The header a broker adds to a request it forwards ([`forward`]): the node that forwarded
/// it. A node that gets a forwarded request answers it itself (or redirects), never forwards
/// it again, so two nodes that disagree about the leader cannot pass a request back and forth.
pub const FORWARDED_BY: &str = "X-Bmq-Forwarded-By";

/// One HTTP/1.1 request without a body on behalf of another client, as
/// [`request_with_status`], with the [`FORWARDED_BY`] header naming `forwarded_by`: returns
/// the status code and the body whatever the status (a 307 too, without following it).
///
/// Errors: the connection fails, or the response is malformed or too large.
pub async fn forward(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    forwarded_by: &str,
) -> anyhow::Result<(u16, Vec<u8>)> {
    let extra = format!("{FORWARDED_BY}: {forwarded_by}\r\n");
    let response = send_and_read_with(addr, method, path, token, &extra).await?;
    let (code, _reason, body) = match parse_http_parts(&response) {
        Err(e) if e.downcast_ref::<Redirect>().is_some() => {
            ("307".to_string(), String::new(), e.to_string().into_bytes())
        }
        other => other?,
    };
    let code = code
        .parse()
        .with_context(|| format!("malformed HTTP status {code:?}"))?;
    Ok((code, body))
}

async fn exchange_once(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<Vec<u8>> {
    let response = send_and_read(addr, method, path, token).await?;
    parse_http_response(&response)
}

/// Sends one request and reads the whole response (the server closes the connection).
async fn send_and_read(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<Vec<u8>> {
    send_and_read_with(addr, method, path, token, "").await
}

/// [`send_and_read`] with `extra` header lines (each ending in CRLF).
async fn send_and_read_with(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    extra: &str,
) -> anyhow::Result<Vec<u8>> {
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let mut stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n\
         Content-Length: 0\r\n{authorization}{extra}User-Agent: bmqctl/{}\r\nConnection: close\r\n\r\n",
        env!("CARGO_PKG_VERSION")
    );
    stream
        .write_all(request.as_bytes())
        .await
        .context("cannot send request")?;
    let mut response = Vec::new();
    // Read one byte past the limit to tell "exactly at the limit" from "over it".
    (&mut stream)
        .take(RESPONSE_MAX_BYTES as u64 + 1)
        .read_to_end(&mut response)
        .await
        .context("cannot read response")?;
    if response.len() > RESPONSE_MAX_BYTES {
        bail!("response larger than {RESPONSE_MAX_BYTES} bytes");
    }
    Ok(response)
}

/// Splits a complete HTTP/1.x response into status and body and returns the body of a 200
/// response. Handles `Content-Length`, `Transfer-Encoding: chunked` and read-to-close bodies.
fn parse_http_response(response: &[u8]) -> anyhow::Result<Vec<u8>> {
    let (code, reason, body) = parse_http_parts(response)?;
    if code != "200" {
        let text = String::from_utf8_lossy(&body);
        let text = text.trim();
        let excerpt: String = text.chars().take(200).collect();
        if excerpt.is_empty() {
            bail!("HTTP {code} {reason}");
        }
        bail!("HTTP {code} {reason}: {excerpt}");
    }
    Ok(body)
}

/// The status code, reason and body of a complete HTTP/1.x response (a 307 with a
/// `Location` is an `Err` of [`Redirect`]).
fn parse_http_parts(response: &[u8]) -> anyhow::Result<(String, String, Vec<u8>)> {
    let head_end = find(response, b"\r\n\r\n").ok_or_else(|| {
        if response.is_empty() {
            anyhow!("connection closed without a response")
        } else {
            anyhow!("malformed HTTP response: no end of headers")
        }
    })?;
    let head = std::str::from_utf8(&response[..head_end])
        .context("malformed HTTP response: headers are not UTF-8")?;
    let raw_body = &response[head_end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    let reason = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        bail!("malformed HTTP status line {status_line:?}");
    }
    let mut content_length = None;
    let mut chunked = false;
    let mut location = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            bail!("malformed HTTP header {line:?}");
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = Some(
                value
                    .parse::<usize>()
                    .with_context(|| format!("malformed Content-Length {value:?}"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("location") {
            location = Some(value.to_string());
        }
    }
    if code == "307" {
        if let Some(location) = location {
            return Err(Redirect(location).into());
        }
    }
    let body = if chunked {
        decode_chunked(raw_body)?
    } else if let Some(len) = content_length {
        if raw_body.len() < len {
            bail!(
                "truncated HTTP body: {} of {len} bytes received",
                raw_body.len()
            );
        }
        raw_body[..len].to_vec()
    } else {
        raw_body.to_vec()
    };
    Ok((code.to_string(), reason.to_string(), body))
}

/// Decodes a `Transfer-Encoding: chunked` body (chunk extensions and trailers are ignored).
fn decode_chunked(mut data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = find(data, b"\r\n").context("truncated chunked body")?;
        let size_line = std::str::from_utf8(&data[..line_end]).context("malformed chunk size")?;
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .with_context(|| format!("malformed chunk size {size_hex:?}"))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        if data.len() < size + 2 {
            bail!("truncated chunked body");
        }
        body.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_content_length_chunked_and_errors() {
        // Bodies framed by Content-Length, chunked encoding or connection close are extracted;
        // a non-200 status becomes an error naming the status and the body.
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(parse_http_response(r).unwrap(), b"hello");
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2;x=y\r\nlo\r\n0\r\n\r\n";
        assert_eq!(parse_http_response(r).unwrap(), b"hello");
        let r = b"HTTP/1.0 200 OK\r\n\r\nhello";
        assert_eq!(parse_http_response(r).unwrap(), b"hello");
        let r = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 8\r\n\r\nstarting";
        let e = parse_http_response(r).unwrap_err().to_string();
        assert_eq!(e, "HTTP 503 Service Unavailable: starting");
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhello";
        assert!(parse_http_response(r)
            .unwrap_err()
            .to_string()
            .contains("truncated"));
        assert!(parse_http_response(b"").is_err());
        assert!(parse_http_response(b"garbage\r\n\r\n").is_err());
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel";
        assert!(parse_http_response(r).is_err());
    }
}
