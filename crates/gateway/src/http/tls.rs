//! TLS with rustls (the `ring` provider): to `https://` workers, and optionally on the listener.
//!
//! Upstream: a worker's certificate is checked against the system's roots, or only against the certificate
//! authorities of `upstream_ca_file` when it is set (as `curl --cacert` does), and its name against the URL's host.
//! The listener: `server.tls_cert_file` (the chain, leaf first) and `server.tls_key_file` (PKCS#8, PKCS#1 or SEC1),
//! PEM; ALPN `http/1.1` for `serve`, `h2` for the Endpoint Picker's gRPC port. With `server.tls_client_ca_file`,
//! clients must present a certificate its authorities issued (mutual TLS). Both are read once, at start, and a bad file stops the start
//! with a message that names it.

use std::path::Path;
use std::sync::Arc;

use hyper_rustls::ConfigBuilderExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate of a PEM file.
fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{what} {}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// The client side, for `https://` workers (or the Kubernetes API server): the system's roots, or only those of
/// `ca_file`, which is the config field `what` in messages.
pub fn client_config(ca_file: Option<&Path>, what: &str) -> Result<ClientConfig, String> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let config = match ca_file {
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates(path, what)? {
                roots.add(cert).map_err(|e| format!("{what} {}: {e}", path.display()))?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        None => match builder.clone().with_native_roots() {
            Ok(with_roots) => with_roots.with_no_client_auth(),
            Err(e) => {
                // Plain-HTTP workers do not need roots; an `https://` one fails its handshake with "UnknownIssuer".
                tracing::warn!(error = %e, "no system certificate roots: https:// workers need upstream_ca_file");
                builder
                    .with_root_certificates(RootCertStore::empty())
                    .with_no_client_auth()
            }
        },
    };
    Ok(config)
}

/// ALPN for an HTTP/1 listener.
pub const HTTP1: &[&[u8]] = &[b"http/1.1"];
/// ALPN for a gRPC listener.
pub const HTTP2: &[&[u8]] = &[b"h2"];

/// The listener's TLS acceptor offering `alpn`, when the `[server]` config has a certificate.
pub fn acceptor(
    server: &crate::config::ServerConfig,
    alpn: &[&[u8]],
) -> Result<Option<tokio_rustls::TlsAcceptor>, String> {
    let (Some(cert), Some(key)) = (&server.tls_cert_file, &server.tls_key_file) else {
        return Ok(None);
    };
    let config = server_config(cert, key, server.tls_client_ca_file.as_deref(), alpn)?;
    Ok(Some(tokio_rustls::TlsAcceptor::from(config)))
}

/// The listener's side, from a certificate chain and its private key, offering `alpn`; with `client_ca_file`,
/// clients must present a certificate issued by one of its authorities (mutual TLS), or the handshake fails.
pub fn server_config(
    cert_file: &Path,
    key_file: &Path,
    client_ca_file: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, String> {
    let chain = certificates(cert_file, "server.tls_cert_file")?;
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("server.tls_key_file {}: {e}", key_file.display()))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_ca_file {
        Some(path) => {
            let what = "server.tls_client_ca_file";
            let mut roots = RootCertStore::empty();
            for cert in certificates(path, what)? {
                roots.add(cert).map_err(|e| format!("{what} {}: {e}", path.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| format!("{what} {}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        format!(
            "server.tls_cert_file {} with server.tls_key_file {}: {e}",
            cert_file.display(),
            key_file.display()
        )
    })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A certificate authority, and certificates it issues.
    struct Authority {
        key: KeyPair,
        cert: rcgen::Certificate,
    }

    impl Authority {
        fn new() -> Self {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "dprouter test CA");
            let cert = params.self_signed(&key).unwrap();
            Self { key, cert }
        }

        fn issue(&self, name: &str, usage: ExtendedKeyUsagePurpose) -> (rcgen::Certificate, KeyPair) {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            (params.signed_by(&key, &self.cert, &self.key).unwrap(), key)
        }
    }

    /// With a client CA, a client is served only with a certificate that CA issued; the ALPN offered is the one
    /// asked for.
    #[tokio::test]
    async fn client_certificates_are_required_with_a_client_ca() {
        let ca = Authority::new();
        let (server_cert, server_key) = ca.issue("localhost", ExtendedKeyUsagePurpose::ServerAuth);
        let (client_cert, client_key) = ca.issue("gateway", ExtendedKeyUsagePurpose::ClientAuth);
        let stranger = Authority::new();
        let (stranger_cert, stranger_key) = stranger.issue("gateway", ExtendedKeyUsagePurpose::ClientAuth);
        let dir = std::env::temp_dir().join(format!("dprouter-mtls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let cert_file = file("cert.pem", server_cert.pem());
        let key_file = file("key.pem", server_key.serialize_pem());
        let ca_file = file("ca.pem", ca.cert.pem());
        let config = server_config(&cert_file, &key_file, Some(&ca_file), HTTP2).unwrap();
        let missing = server_config(&cert_file, &key_file, Some(&dir.join("none.pem")), HTTP2).unwrap_err();
        assert!(missing.contains("server.tls_client_ca_file"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);

        // One exchange: the client writes a byte and reads it back; `Err` if the server refused it.
        let exchange = |identity: Option<(&rcgen::Certificate, &KeyPair)>| {
            let acceptor = acceptor.clone();
            let mut roots = RootCertStore::empty();
            roots.add(ca.cert.der().clone()).unwrap();
            let builder = ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots);
            let mut client = match identity {
                Some((cert, key)) => {
                    let key = PrivateKeyDer::try_from(key.serialize_der()).unwrap();
                    builder.with_client_auth_cert(vec![cert.der().clone()], key).unwrap()
                }
                None => builder.with_no_client_auth(),
            };
            client.alpn_protocols = vec![b"h2".to_vec()];
            async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                let server = tokio::spawn(async move {
                    let (tcp, _) = listener.accept().await.unwrap();
                    let mut tls = acceptor.accept(tcp).await.map_err(|e| e.to_string())?;
                    let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
                    let mut byte = [0u8];
                    tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
                    tls.write_all(&byte).await.map_err(|e| e.to_string())?;
                    tls.flush().await.map_err(|e| e.to_string())?;
                    Ok::<_, String>(alpn)
                });
                let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
                let client = async {
                    let mut tls = connector.connect(name, tcp).await.map_err(|e| e.to_string())?;
                    tls.write_all(b"x").await.map_err(|e| e.to_string())?;
                    let mut byte = [0u8];
                    tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
                    Ok::<_, String>(())
                };
                let client = client.await;
                let server = server.await.unwrap();
                client.and(server)
            }
        };
        assert_eq!(
            exchange(Some((&client_cert, &client_key))).await,
            Ok(Some(b"h2".to_vec()))
        );
        let refused = exchange(None).await.unwrap_err();
        assert!(
            refused.contains("certificate") || refused.contains("Certificate"),
            "{refused}"
        );
        // Issued by another authority of the same name: its signature does not verify.
        assert!(exchange(Some((&stranger_cert, &stranger_key))).await.is_err());
    }
}
