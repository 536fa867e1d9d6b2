//! A real NATS server with JetStream (Debian's `nats-server`) for the `nats` channel kind:
//! started on a free loopback port with file storage in a directory of its own, killed with
//! SIGKILL and restarted on the same port and storage, stopped when dropped. A JetStream
//! client of the tests' own makes streams and reads every message a stream holds.

use async_nats::jetstream::{self, stream};
use std::collections::HashMap;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One message a stream holds.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub subject: String,
    /// Its `Nats-Msg-Id`.
    pub msg_id: Option<String>,
    pub payload: String,
}

pub struct NatsServer {
    pub port: u16,
    dir: PathBuf,
    token: Option<String>,
    child: Option<Child>,
    runtime: tokio::runtime::Runtime,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl NatsServer {
    /// Starts a server with JetStream on file storage; `token`: clients must present it.
    pub fn start(token: Option<&str>) -> NatsServer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("outbox-nats-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("nats storage directory");
        let mut server = NatsServer {
            port,
            dir,
            token: token.map(str::to_string),
            child: None,
            runtime: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime"),
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("nats-server");
        cmd.args([
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-sd",
        ])
        .arg(&self.dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if let Some(t) = &self.token {
            cmd.args(["--auth", t]);
        }
        self.child = Some(
            cmd.spawn()
                .expect("nats-server (Debian package nats-server; scripts/setup.sh installs it)"),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL (what it had not written to its storage is lost).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and storage.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    fn context(&self) -> jetstream::Context {
        let url = self.url();
        let token = self.token.clone();
        self.runtime.block_on(async move {
            let mut options = async_nats::ConnectOptions::new();
            if let Some(t) = token {
                options = options.token(t);
            }
            let client = async_nats::connect_with_options(url, options)
                .await
                .expect("connect to nats-server");
            jetstream::new(client)
        })
    }

    /// Creates (or replaces) a stream on `subjects` with a duplicate window.
    pub fn create_stream(&self, name: &str, subjects: &[&str], duplicate_window: Duration) {
        let js = self.context();
        let config = stream::Config {
            name: name.to_string(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            duplicate_window,
            storage: stream::StorageType::File,
            allow_direct: true,
            ..Default::default()
        };
        self.runtime.block_on(async move {
            let _ = js.delete_stream(&config.name).await;
            js.create_stream(config).await.expect("create stream");
        });
    }

    pub fn delete_stream(&self, name: &str) {
        let js = self.context();
        let name = name.to_string();
        self.runtime.block_on(async move {
            js.delete_stream(&name).await.expect("delete stream");
        });
    }

    /// Every message the stream holds, in order.
    pub fn messages(&self, name: &str) -> Vec<Stored> {
        let js = self.context();
        let name = name.to_string();
        self.runtime.block_on(async move {
            let Ok(mut s) = js.get_stream(&name).await else {
                return Vec::new();
            };
            let state = s.info().await.expect("stream info").state.clone();
            let mut out = Vec::new();
            if state.messages == 0 {
                return out;
            }
            for seq in state.first_sequence..=state.last_sequence {
                if let Ok(m) = s.get_raw_message(seq).await {
                    out.push(Stored {
                        sequence: m.sequence,
                        subject: m.subject.to_string(),
                        msg_id: m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_string()),
                        payload: String::from_utf8_lossy(&m.payload).into_owned(),
                    });
                }
            }
            out
        })
    }

    /// How many messages of the stream carry each `Nats-Msg-Id`.
    pub fn copies_by_id(&self, name: &str) -> HashMap<String, usize> {
        let mut copies = HashMap::new();
        for m in self.messages(name) {
            *copies.entry(m.msg_id.unwrap_or_default()).or_insert(0) += 1;
        }
        copies
    }

    /// Publishes straight to the stream with a `Nats-Msg-Id`, as another producer would.
    pub fn publish(&self, subject: &str, msg_id: &str, payload: &str) -> u64 {
        let js = self.context();
        let (subject, msg_id, payload) =
            (subject.to_string(), msg_id.to_string(), payload.to_string());
        self.runtime.block_on(async move {
            let message = jetstream::message::PublishMessage::build()
                .payload(payload.into())
                .message_id(msg_id);
            js.send_publish(subject, message)
                .await
                .expect("publish")
                .await
                .expect("ack")
                .sequence
        })
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server started by someone else (the benchmark's script): makes a stream with file
/// storage on `subjects` (replacing one of that name).
pub fn create_file_stream(url: &str, name: &str, subjects: &[&str], duplicate_window: Duration) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let config = stream::Config {
        name: name.to_string(),
        subjects: subjects.iter().map(|s| s.to_string()).collect(),
        duplicate_window,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    runtime.block_on(async move {
        let client = async_nats::connect(url)
            .await
            .expect("connect to nats-server");
        let js = jetstream::new(client);
        let _ = js.delete_stream(&config.name).await;
        js.create_stream(config).await.expect("create stream");
    });
}

/// How many messages a stream of a server started by someone else holds.
pub fn stream_count(url: &str, name: &str) -> u64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let client = async_nats::connect(url)
            .await
            .expect("connect to nats-server");
        let js = jetstream::new(client);
        let mut s = js.get_stream(name).await.expect("stream");
        s.info().await.expect("stream info").state.messages
    })
}
