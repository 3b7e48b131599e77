//! TLS with rustls (the `ring` provider): to `https://` workers, and optionally on the listener.
//!
//! Upstream: a worker's certificate is checked against the system's roots, or only against the certificate
//! authorities of `upstream_ca_file` when it is set (as `curl --cacert` does), and its name against the URL's host.
//! The listener: `server.tls_cert_file` (the chain, leaf first) and `server.tls_key_file` (PKCS#8, PKCS#1 or SEC1),
//! PEM; HTTP/1.1 only, as the rest of the gateway. Both are read once, at start, and a bad file stops the start
//! with a message that names it.

use std::path::Path;
use std::sync::Arc;

use hyper_rustls::ConfigBuilderExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
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

/// The listener's side, from a certificate chain and its private key.
pub fn server_config(cert_file: &Path, key_file: &Path) -> Result<Arc<ServerConfig>, String> {
    let chain = certificates(cert_file, "server.tls_cert_file")?;
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("server.tls_key_file {}: {e}", key_file.display()))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            format!(
                "server.tls_cert_file {} with server.tls_key_file {}: {e}",
                cert_file.display(),
                key_file.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
