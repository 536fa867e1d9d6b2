//! Certificates for the HTTPS tests, made by the `openssl` command line at test time: a CA
//! the tests trust, a second CA they do not, a server certificate for `127.0.0.1` and
//! `localhost`, one for another host name, and a client certificate for mutual TLS. EC P-256,
//! valid for a day. Every PEM is read back as text.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A certificate with its private key, both PEM.
#[derive(Clone, Debug)]
pub struct Pair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Everything the HTTPS tests use.
#[derive(Clone, Debug)]
pub struct TestPki {
    /// The CA the tests trust (`tls.ca_pem`).
    pub ca: Pair,
    /// A CA no channel trusts.
    pub other_ca: Pair,
    /// Signed by `ca`, for IP 127.0.0.1 and DNS localhost.
    pub server: Pair,
    /// Signed by `ca`, for DNS `wrong.example` only.
    pub wrong_host: Pair,
    /// Signed by `other_ca`, for 127.0.0.1.
    pub untrusted_server: Pair,
    /// Signed by `ca`, for client authentication.
    pub client: Pair,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (Debian package openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
}

fn key(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            name,
        ],
    );
}

fn ca(dir: &Path, name: &str, cn: &str) -> Pair {
    let key_file = format!("{name}.key");
    let cert_file = format!("{name}.pem");
    key(dir, &key_file);
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            &key_file,
            "-subj",
            &format!("/CN={cn}"),
            "-days",
            "1",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-out",
            &cert_file,
        ],
    );
    Pair {
        cert_pem: read(dir, &cert_file),
        key_pem: read(dir, &key_file),
    }
}

/// A leaf signed by CA `issuer` (files `issuer.pem`, `issuer.key`) with extensions `ext`.
fn leaf(dir: &Path, name: &str, issuer: &str, ext: &str) -> Pair {
    let key_file = format!("{name}.key");
    key(dir, &key_file);
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &key_file,
            "-subj",
            &format!("/CN={name}"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    std::fs::write(dir.join(format!("{name}.ext")), ext).expect("write ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{issuer}.pem"),
            "-CAkey",
            &format!("{issuer}.key"),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ],
    );
    Pair {
        cert_pem: read(dir, &format!("{name}.pem")),
        key_pem: read(dir, &key_file),
    }
}

const SERVER_EXT: &str = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n";

impl TestPki {
    /// Makes everything in a new directory under the system's temporary directory.
    pub fn generate() -> TestPki {
        let dir: PathBuf = std::env::temp_dir().join(crate::cluster::unique("outbox_pki"));
        std::fs::create_dir_all(&dir).expect("create the PKI directory");
        let pki = TestPki {
            ca: ca(&dir, "ca", "outbox test CA"),
            other_ca: ca(&dir, "other_ca", "outbox untrusted CA"),
            server: leaf(&dir, "server", "ca", SERVER_EXT),
            wrong_host: leaf(
                &dir,
                "wrong_host",
                "ca",
                "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
                 extendedKeyUsage=serverAuth\nsubjectAltName=DNS:wrong.example\n",
            ),
            untrusted_server: leaf(&dir, "untrusted", "other_ca", SERVER_EXT),
            client: leaf(
                &dir,
                "client",
                "ca",
                "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
                 extendedKeyUsage=clientAuth\n",
            ),
        };
        let _ = std::fs::remove_dir_all(&dir);
        pki
    }
}
