//! HTTPS in front of the provider simulator: a TLS server on a loopback port of its own
//! that terminates TLS (rustls) and passes each connection's bytes to the plain simulator,
//! one backend connection per client connection (so keep-alive stays what the client made
//! it). It can require a client certificate signed by a given CA (mutual TLS). It counts
//! handshakes that completed and that failed, and the connections it accepted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// What the front has seen.
#[derive(Default)]
pub struct FrontCounters {
    pub connections: AtomicU64,
    pub handshakes: AtomicU64,
    pub failed_handshakes: AtomicU64,
}

/// A running HTTPS front; stops when dropped.
pub struct TlsFront {
    port: u16,
    counters: Arc<FrontCounters>,
    stop: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(cert_pem: &str, key_pem: &str, client_ca_pem: Option<&str>) -> ServerConfig {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("server certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("server key PEM");
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("TLS versions");
    let builder = match client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
                roots.add(c.expect("client CA PEM")).expect("client CA");
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        }
    };
    builder
        .with_single_cert(certs, key)
        .expect("server certificate and key")
}

impl TlsFront {
    /// Serves TLS with `cert_pem`/`key_pem` on a free loopback port, passing connections to
    /// `127.0.0.1:backend_port`; with `client_ca_pem`, a client certificate signed by it is
    /// required.
    pub fn start(
        backend_port: u16,
        cert_pem: &str,
        key_pem: &str,
        client_ca_pem: Option<&str>,
    ) -> TlsFront {
        let acceptor = TlsAcceptor::from(Arc::new(server_config(cert_pem, key_pem, client_ca_pem)));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("TLS front runtime");
        let listener = {
            let _guard = rt.enter();
            crate::sim::listen_on_loopback(0).expect("bind the TLS front")
        };
        let port = listener.local_addr().expect("local address").port();
        let counters = Arc::new(FrontCounters::default());
        let c = counters.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            rt.block_on(accept_loop(listener, acceptor, backend_port, c, rx));
            rt.shutdown_timeout(Duration::from_secs(1));
        });
        TlsFront {
            port,
            counters,
            stop: Some((tx, thread)),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `https://127.0.0.1:PORT/ch/{channel}`, the simulator's send URL over TLS.
    pub fn send_url(&self, channel: &str) -> String {
        format!("https://127.0.0.1:{}/ch/{channel}", self.port)
    }

    pub fn counters(&self) -> &FrontCounters {
        &self.counters
    }

    pub fn count(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some((tx, thread)) = self.stop.take() {
            let _ = tx.send(());
            let _ = thread.join();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    backend_port: u16,
    counters: Arc<FrontCounters>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else { continue };
        counters.connections.fetch_add(1, Ordering::Relaxed);
        let acceptor = acceptor.clone();
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut tls = match acceptor.accept(stream).await {
                Ok(t) => t,
                Err(_) => {
                    counters.failed_handshakes.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            counters.handshakes.fetch_add(1, Ordering::Relaxed);
            let Ok(mut backend) = TcpStream::connect(("127.0.0.1", backend_port)).await else {
                return;
            };
            let _ = backend.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut tls, &mut backend).await;
        });
    }
}
