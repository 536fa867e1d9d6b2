//! The hand-written HTTP/1.1 server: accept loop, request framing, limits, keep-alive
//! and response writing.

use super::*;

// ---------------------------------------------------------------------------------------
// Server

pub(super) async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = &mut stop => return,
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    bump(&shared.counters.connections);
                    let open = OpenConnection::count(&shared);
                    let served = serve_connection(shared.clone(), stream);
                    tokio::spawn(async move {
                        let _open = open;
                        served.await;
                    });
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

/// One connection counted in `open_connections` until it is dropped: when its task ends,
/// panics or is cancelled with the runtime.
struct OpenConnection(Arc<Shared>);

impl OpenConnection {
    fn count(shared: &Arc<Shared>) -> OpenConnection {
        shared.open_connections.fetch_add(1, Ordering::Relaxed);
        OpenConnection(shared.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(super) const MAX_HEAD: usize = 64 * 1024;
const MAX_BODY: usize = 16 * 1024 * 1024;
pub(super) const MAX_HEADERS: usize = 200;
const MAX_CHUNK_LINE: usize = 4096;

/// `(start, end)` byte offsets into the connection's read buffer.
type Span = (usize, usize);

struct Head {
    method: Span,
    target: Span,
    http10: bool,
    keep_alive: bool,
    content_length: Option<usize>,
    chunked: bool,
    expect_continue: bool,
}

/// What the connection does after a request has been handled.
pub(super) enum After {
    /// Write the response, then read the next request unless the connection is to close.
    Respond,
    /// Write nothing, keep the connection open until the peer closes it.
    Hang,
    /// Write nothing, reset the connection.
    Drop,
}

/// Response under construction; both buffers are reused across requests.
///
/// The body is `body`, then `pad` bytes `x`, then `tail`; the last two are only used by
/// [`Action::AcceptLarge`], whose padding is written from [`PAD`] rather than held here.
pub(super) struct Out {
    pub(super) head: Vec<u8>,
    pub(super) body: Vec<u8>,
    pub(super) pad: usize,
    pub(super) tail: &'static [u8],
}

/// What the padding of a large answer is written from, one slice at a time.
static PAD: [u8; 64 * 1024] = [b'x'; 64 * 1024];

impl Out {
    pub(super) fn new() -> Out {
        Out {
            head: Vec::with_capacity(512),
            body: Vec::with_capacity(256),
            pad: 0,
            tail: b"",
        }
    }

    pub(super) fn start(&mut self, status: u16) {
        self.head.clear();
        self.body.clear();
        self.pad = 0;
        self.tail = b"";
        let _ = write!(
            VecWriter(&mut self.head),
            "HTTP/1.1 {} {}\r\n",
            status,
            reason(status)
        );
    }

    pub(super) fn header(&mut self, name: &str, value: &str) {
        self.head.extend_from_slice(name.as_bytes());
        self.head.extend_from_slice(b": ");
        // Header values given by a test could contain CR/LF; never let them split the head.
        self.head
            .extend(value.bytes().filter(|b| *b != b'\r' && *b != b'\n'));
        self.head.extend_from_slice(b"\r\n");
    }

    /// Adds the framing headers and appends the body (not for a `HEAD` request): `head` is
    /// then the whole response, but for the padding and tail of a large answer
    /// ([`Out::write`] writes those after it).
    pub(super) fn finish(&mut self, keep_alive: bool, http10: bool, head_request: bool) {
        let _ = write!(
            VecWriter(&mut self.head),
            "Content-Length: {}\r\n",
            self.body.len() + self.pad + self.tail.len()
        );
        if !keep_alive {
            self.head.extend_from_slice(b"Connection: close\r\n");
        } else if http10 {
            self.head.extend_from_slice(b"Connection: keep-alive\r\n");
        }
        self.head.extend_from_slice(b"\r\n");
        if head_request {
            self.pad = 0;
            self.tail = b"";
        } else {
            self.head.extend_from_slice(&self.body);
        }
    }

    /// Writes a finished response: one write call, plus, for a large answer, its padding
    /// in slices of [`PAD`] and its tail. An error (the client went away) ends only this
    /// connection.
    pub(super) async fn write(&self, stream: &mut TcpStream) -> io::Result<()> {
        stream.write_all(&self.head).await?;
        let mut left = self.pad;
        while left > 0 {
            let n = left.min(PAD.len());
            stream.write_all(&PAD[..n]).await?;
            left -= n;
        }
        if !self.tail.is_empty() {
            stream.write_all(self.tail).await?;
        }
        Ok(())
    }

    pub(super) fn json_error(&mut self, status: u16, msg: &str) {
        self.start(status);
        self.header("Content-Type", "application/json");
        self.body.extend_from_slice(b"{\"error\":");
        json_str(&mut self.body, msg);
        self.body.push(b'}');
    }
}

/// `fmt::Write` into a byte vector.
pub(super) struct VecWriter<'a>(pub(super) &'a mut Vec<u8>);

impl std::fmt::Write for VecWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        413 => "Content Too Large",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// Reads more bytes into `buf`; `Ok(0)` at end of stream.
async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 2048 {
        buf.reserve(8192);
    }
    stream.read_buf(buf).await
}

/// Reads more of a request body, after the `100 Continue` the client waits for when it has
/// not been sent yet; false when the connection ended or failed.
async fn read_more_body(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    sent_continue: &mut bool,
) -> bool {
    if !*sent_continue {
        *sent_continue = true;
        if stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_err()
        {
            return false;
        }
    }
    matches!(read_more(stream, buf).await, Ok(n) if n > 0)
}

async fn serve_connection(shared: Arc<Shared>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut headers: Vec<(Span, Span)> = Vec::with_capacity(16);
    let mut chunk_body: Vec<u8> = Vec::new();
    let mut out = Out::new();
    loop {
        // 1. The head: up to the empty line. Empty lines before a request are skipped.
        let mut scanned = 0;
        let head_end = loop {
            let skip = leading_empty_lines(&buf);
            if skip > 0 {
                buf.drain(..skip);
                scanned = 0;
            }
            if let Some(i) = find_head_end(&buf, scanned) {
                break i;
            }
            if buf.len() > MAX_HEAD {
                // No end within the limit: refused just below.
                break buf.len();
            }
            scanned = buf.len().saturating_sub(3);
            match read_more(&mut stream, &mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        };
        if head_end > MAX_HEAD {
            reject(
                &shared,
                &mut stream,
                &mut out,
                431,
                "request head too large",
            )
            .await;
            return;
        }
        let head = match parse_head(&buf, head_end, &mut headers) {
            Ok(h) => h,
            Err(msg) => {
                reject(&shared, &mut stream, &mut out, 400, msg).await;
                return;
            }
        };
        let head_len = head_end + 4;

        // 2. The body.
        let mut sent_continue = !head.expect_continue || head.http10;
        let consumed = if head.chunked {
            chunk_body.clear();
            let mut dec = ChunkDecoder {
                pos: head_len,
                state: ChunkState::Size,
            };
            loop {
                match dec.decode(&buf, &mut chunk_body) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err((status, msg)) => {
                        reject(&shared, &mut stream, &mut out, status, msg).await;
                        return;
                    }
                }
                if !read_more_body(&mut stream, &mut buf, &mut sent_continue).await {
                    return;
                }
            }
            dec.pos
        } else {
            let len = head.content_length.unwrap_or(0);
            if len > MAX_BODY {
                reject(
                    &shared,
                    &mut stream,
                    &mut out,
                    413,
                    "request body too large",
                )
                .await;
                return;
            }
            if len > 0 && buf.len() < head_len + len {
                buf.reserve(head_len + len - buf.len());
            }
            while buf.len() < head_len + len {
                if !read_more_body(&mut stream, &mut buf, &mut sent_continue).await {
                    return;
                }
            }
            head_len + len
        };

        // 3. Handle it.
        let after = {
            let body: &[u8] = if head.chunked {
                &chunk_body
            } else {
                &buf[head_len..consumed]
            };
            let req = Request {
                buf: &buf,
                // Both were checked to be ASCII by parse_head.
                method: std::str::from_utf8(&buf[head.method.0..head.method.1]).unwrap_or("?"),
                target: std::str::from_utf8(&buf[head.target.0..head.target.1]).unwrap_or("/"),
                headers: &headers,
                body,
            };
            handle(&shared, &req, &mut out).await
        };

        // 4. Answer (or not).
        match after {
            After::Respond => {
                let keep = head.keep_alive;
                out.finish(
                    keep,
                    head.http10,
                    &buf[head.method.0..head.method.1] == b"HEAD",
                );
                if out.write(&mut stream).await.is_err() {
                    return;
                }
                if !keep {
                    let _ = stream.shutdown().await;
                    return;
                }
            }
            After::Hang => {
                // Keep reading (and discarding) until the peer goes away; shutdown of the
                // simulator drops this task and so closes the socket.
                let mut sink = [0u8; 1024];
                loop {
                    match stream.read(&mut sink).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            }
            After::Drop => {
                let _ = stream.set_zero_linger();
                return;
            }
        }
        buf.drain(..consumed);
        // Do not let one huge request pin memory for the life of the connection.
        if buf.capacity() > 1 << 20 {
            buf.shrink_to(64 * 1024);
        }
        if chunk_body.capacity() > 1 << 20 {
            chunk_body = Vec::new();
        }
    }
}

/// Answers a malformed request and closes the connection.
async fn reject(shared: &Shared, stream: &mut TcpStream, out: &mut Out, status: u16, msg: &str) {
    bump(&shared.counters.bad_requests);
    out.json_error(status, msg);
    out.finish(false, false, false);
    if out.write(stream).await.is_ok() {
        let _ = stream.shutdown().await;
        // Give the client a moment to read the answer before the socket goes away with
        // unread input still in it (which would make the kernel send a reset).
        let mut sink = [0u8; 1024];
        let drain = async {
            loop {
                match stream.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
    }
}

fn leading_empty_lines(buf: &[u8]) -> usize {
    let mut i = 0;
    while buf.len() >= i + 2 && &buf[i..i + 2] == b"\r\n" {
        i += 2;
    }
    i
}

/// Index of the `\r\n\r\n` ending the head, searching from `from`.
pub(super) fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    if buf.len() < 4 {
        return None;
    }
    let mut i = from;
    while i + 4 <= buf.len() {
        // Jump to the next CR quickly.
        match buf[i..buf.len() - 3].iter().position(|&b| b == b'\r') {
            None => return None,
            Some(p) => i += p,
        }
        if &buf[i..i + 4] == b"\r\n\r\n" {
            return Some(i);
        }
        i += 1;
    }
    None
}

fn find_crlf(buf: &[u8], from: usize, to: usize) -> Option<usize> {
    buf[from..to]
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|p| from + p)
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn trim_ows(buf: &[u8], mut s: usize, mut e: usize) -> Span {
    while s < e && (buf[s] == b' ' || buf[s] == b'\t') {
        s += 1;
    }
    while e > s && (buf[e - 1] == b' ' || buf[e - 1] == b'\t') {
        e -= 1;
    }
    (s, e)
}

fn parse_head(
    buf: &[u8],
    head_end: usize,
    headers: &mut Vec<(Span, Span)>,
) -> Result<Head, &'static str> {
    headers.clear();
    // Request line.
    let line_end = find_crlf(buf, 0, head_end + 2).ok_or("bad request line")?;
    let line = &buf[..line_end];
    let sp1 = line
        .iter()
        .position(|&b| b == b' ')
        .ok_or("bad request line")?;
    let rest = &line[sp1 + 1..];
    let sp2 = rest
        .iter()
        .position(|&b| b == b' ')
        .ok_or("bad request line")?;
    let method = (0, sp1);
    let target = (sp1 + 1, sp1 + 1 + sp2);
    let version = &rest[sp2 + 1..];
    if method.0 == method.1 || !buf[method.0..method.1].iter().all(|&b| is_tchar(b)) {
        return Err("bad method");
    }
    if target.0 == target.1
        || !buf[target.0..target.1]
            .iter()
            .all(|&b| (0x21..0x7f).contains(&b))
    {
        return Err("bad request target");
    }
    let http10 = match version {
        b"HTTP/1.1" => false,
        b"HTTP/1.0" => true,
        _ => return Err("unsupported HTTP version"),
    };

    let mut content_length: Option<usize> = None;
    let mut te_seen = false;
    let mut chunked = false;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    let mut expect_continue = false;

    let mut pos = line_end + 2;
    while pos < head_end + 2 {
        let e = find_crlf(buf, pos, head_end + 2).ok_or("bad header line")?;
        let line = &buf[pos..e];
        if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
            return Err("obsolete header line folding");
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or("header line without colon")?;
        let name = (pos, pos + colon);
        if name.0 == name.1 || !buf[name.0..name.1].iter().all(|&b| is_tchar(b)) {
            return Err("bad header name");
        }
        let value = trim_ows(buf, pos + colon + 1, e);
        if buf[value.0..value.1]
            .iter()
            .any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f)
        {
            return Err("control character in header value");
        }
        if headers.len() >= MAX_HEADERS {
            return Err("too many headers");
        }
        headers.push((name, value));

        let n = &buf[name.0..name.1];
        let v = &buf[value.0..value.1];
        if n.eq_ignore_ascii_case(b"content-length") {
            if v.is_empty() || v.len() > 15 || !v.iter().all(u8::is_ascii_digit) {
                return Err("bad content-length");
            }
            let len = v
                .iter()
                .fold(0usize, |acc, d| acc * 10 + usize::from(d - b'0'));
            if content_length.is_some_and(|l| l != len) {
                return Err("conflicting content-length headers");
            }
            content_length = Some(len);
        } else if n.eq_ignore_ascii_case(b"transfer-encoding") {
            if te_seen || !v.eq_ignore_ascii_case(b"chunked") {
                return Err("unsupported transfer-encoding (only a single 'chunked')");
            }
            te_seen = true;
            chunked = true;
        } else if n.eq_ignore_ascii_case(b"connection") {
            for tok in v.split(|&b| b == b',') {
                let (s, e) = trim_ows(tok, 0, tok.len());
                let tok = &tok[s..e];
                if tok.eq_ignore_ascii_case(b"close") {
                    conn_close = true;
                } else if tok.eq_ignore_ascii_case(b"keep-alive") {
                    conn_keep_alive = true;
                }
            }
        } else if n.eq_ignore_ascii_case(b"expect") && v.eq_ignore_ascii_case(b"100-continue") {
            expect_continue = true;
        }
        pos = e + 2;
    }
    if chunked && content_length.is_some() {
        return Err("both content-length and transfer-encoding");
    }
    if chunked && http10 {
        return Err("chunked transfer-encoding in HTTP/1.0");
    }
    let keep_alive = if http10 {
        conn_keep_alive && !conn_close
    } else {
        !conn_close
    };
    Ok(Head {
        method,
        target,
        http10,
        keep_alive,
        content_length,
        chunked,
        expect_continue,
    })
}

enum ChunkState {
    Size,
    Data(usize),
    DataEnd,
    Trailers,
}

/// Incremental decoder of a chunked body, resumable as more bytes arrive.
struct ChunkDecoder {
    /// Next unread byte of the connection buffer.
    pos: usize,
    state: ChunkState,
}

impl ChunkDecoder {
    /// Decodes what is available; `Ok(true)` once the whole body (with trailers) is read.
    fn decode(&mut self, buf: &[u8], body: &mut Vec<u8>) -> Result<bool, (u16, &'static str)> {
        loop {
            match self.state {
                ChunkState::Size => {
                    let Some(e) = find_crlf(buf, self.pos, buf.len()) else {
                        if buf.len() - self.pos > MAX_CHUNK_LINE {
                            return Err((400, "chunk size line too long"));
                        }
                        return Ok(false);
                    };
                    let line = &buf[self.pos..e];
                    let size_part = match line.iter().position(|&b| b == b';') {
                        Some(p) => &line[..p],
                        None => line,
                    };
                    let (s, t) = trim_ows(size_part, 0, size_part.len());
                    let hex = &size_part[s..t];
                    if hex.is_empty() || hex.len() > 8 {
                        return Err((400, "bad chunk size"));
                    }
                    let mut size = 0usize;
                    for &b in hex {
                        let d = (b as char).to_digit(16).ok_or((400, "bad chunk size"))?;
                        size = size * 16 + d as usize;
                    }
                    if body.len() + size > MAX_BODY {
                        return Err((413, "request body too large"));
                    }
                    self.pos = e + 2;
                    self.state = if size == 0 {
                        ChunkState::Trailers
                    } else {
                        ChunkState::Data(size)
                    };
                }
                ChunkState::Data(rem) => {
                    let avail = (buf.len() - self.pos).min(rem);
                    body.extend_from_slice(&buf[self.pos..self.pos + avail]);
                    self.pos += avail;
                    if avail < rem {
                        self.state = ChunkState::Data(rem - avail);
                        return Ok(false);
                    }
                    self.state = ChunkState::DataEnd;
                }
                ChunkState::DataEnd => {
                    if buf.len() - self.pos < 2 {
                        return Ok(false);
                    }
                    if &buf[self.pos..self.pos + 2] != b"\r\n" {
                        return Err((400, "chunk data not followed by CRLF"));
                    }
                    self.pos += 2;
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    let Some(e) = find_crlf(buf, self.pos, buf.len()) else {
                        if buf.len() - self.pos > MAX_HEAD {
                            return Err((431, "trailers too large"));
                        }
                        return Ok(false);
                    };
                    let empty = e == self.pos;
                    self.pos = e + 2;
                    if empty {
                        return Ok(true);
                    }
                }
            }
        }
    }
}

pub(super) struct Request<'a> {
    pub(super) buf: &'a [u8],
    pub(super) method: &'a str,
    pub(super) target: &'a str,
    pub(super) headers: &'a [(Span, Span)],
    pub(super) body: &'a [u8],
}

impl Request<'_> {
    pub(super) fn header_iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers
            .iter()
            .map(|(n, v)| (&self.buf[n.0..n.1], &self.buf[v.0..v.1]))
    }

    /// First value of header `name` (ASCII case-insensitive).
    pub(super) fn header(&self, name: &str) -> Option<&[u8]> {
        self.header_iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The send's key and whether it came from the channel's dedupe header.
    pub(super) fn send_key(&self, dedupe_header: Option<&str>) -> (Option<String>, bool) {
        if let Some(v) = dedupe_header.and_then(|h| self.header(h)) {
            return (Some(String::from_utf8_lossy(v).into_owned()), true);
        }
        let v = self
            .header("idempotency-key")
            .or_else(|| self.header("x-effect-key"));
        (v.map(|v| String::from_utf8_lossy(v).into_owned()), false)
    }

    /// A `Received` with everything but the parts known only after handling.
    pub(super) fn draft(&self, shared: &Shared, channel: &str, kind: &'static str) -> Received {
        Received {
            seq: 0,
            channel: channel.to_owned(),
            kind,
            method: self.method.to_owned(),
            path: self.target.to_owned(),
            headers: self
                .header_iter()
                .map(|(n, v)| {
                    (
                        String::from_utf8_lossy(n).to_ascii_lowercase(),
                        String::from_utf8_lossy(v).into_owned(),
                    )
                })
                .collect(),
            body: if shared.record_bodies.load(Ordering::Relaxed) {
                self.body.to_vec()
            } else {
                Vec::new()
            },
            received_at: SystemTime::now(),
            outcome: String::new(),
            external_id: None,
            key: None,
            status: None,
        }
    }
}
