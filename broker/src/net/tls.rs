//! TLS (rustls with the `ring` provider) on the node side.
//!
//! - **Peer links** are mutual TLS under the cluster CA (`[tls] ca_file`): each node presents
//!   `cert_file`/`key_file`, whose certificate must carry the DNS subject alternative name
//!   `node-<id>` ([`bmq_proto::member_name`]) of its member id. The dialer verifies that the
//!   listener's certificate names the member it dialed; the listener verifies that the dialer's
//!   certificate chains to the CA and names the member id its `PeerHello` claims
//!   ([`certificate_names`]). Anything else closes the connection before any elector or
//!   metadata message is read.
//! - **Client listener** (`[tls] client_listener = true`, the default when `[tls]` is present):
//!   server-side TLS with the same node certificate; clients verify it against the CA and the
//!   host they dialed, so a node certificate also names the member's host (an IP address or a
//!   DNS name) and `localhost`.
//!
//! The PEM helpers are the client library's ([`bmq_client::tls`]). Certificates and keys are
//! read once at start: rotation is a restart with new files.

use std::sync::Arc;

use bmq_client::tls::{crypto_provider, load_certs, load_key, root_store, rustls_error, TlsError};
use bmq_config::TlsSettings;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The TLS side of a node: the mutual-TLS acceptor and connector of the peer links, and the
/// acceptor of the client listener when it is enabled.
#[derive(Clone)]
pub struct PeerTls {
    /// Accepts peer connections; requires a client certificate chaining to the cluster CA.
    pub peer_acceptor: TlsAcceptor,
    /// Dials peers presenting this node's certificate; verifies the peer's against the CA.
    pub peer_connector: TlsConnector,
    /// Dials a `join` address, whose member id is not known yet: as `peer_connector`, but the
    /// listener's certificate may name any member (`node-<id>`; [`AnyMemberVerifier`]). The
    /// caller checks that it names the id the listener's hello claims.
    pub join_connector: TlsConnector,
    /// Accepts client connections (no client certificate); `None` when
    /// `client_listener = false`.
    pub client_acceptor: Option<TlsAcceptor>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("client_listener", &self.client_acceptor.is_some())
            .finish()
    }
}

impl PeerTls {
    /// Reads the CA, the certificate and the key, and builds the three configurations.
    ///
    /// Errors: [`TlsError::Pem`] for an unreadable file, [`TlsError::Rustls`] for a key that
    /// does not match its certificate or an unusable CA.
    pub fn load(settings: &TlsSettings) -> Result<PeerTls, TlsError> {
        let roots = Arc::new(root_store(&settings.ca_file)?);
        let certs = load_certs(&settings.cert_file, "certificate")?;
        let key = load_key(&settings.key_file)?;

        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            crypto_provider(),
        )
        .build()
        .map_err(rustls_error)?;
        let peer_server = rustls::ServerConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(rustls_error)?;
        let peer_client = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(rustls_error)?;
        let any_member = AnyMemberVerifier {
            inner: rustls::client::WebPkiServerVerifier::builder_with_provider(
                roots,
                crypto_provider(),
            )
            .build()
            .map_err(rustls_error)?,
        };
        let join_client = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(any_member))
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(rustls_error)?;
        let client_acceptor = if settings.client_listener {
            let server = rustls::ServerConfig::builder_with_provider(crypto_provider())
                .with_safe_default_protocol_versions()
                .map_err(rustls_error)?
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .map_err(rustls_error)?;
            Some(TlsAcceptor::from(Arc::new(server)))
        } else {
            None
        };
        Ok(PeerTls {
            peer_acceptor: TlsAcceptor::from(Arc::new(peer_server)),
            peer_connector: TlsConnector::from(Arc::new(peer_client)),
            join_connector: TlsConnector::from(Arc::new(join_client)),
            client_acceptor,
        })
    }
}

/// Verifies a listener's certificate as the peer dialer does (its chain to the cluster CA, its
/// validity, that it names a member), for a dial whose member id is not known: the name
/// checked is the first `node-<id>` the certificate carries, not the dialed one. Signatures are
/// checked by the standard verifier.
#[derive(Debug)]
pub struct AnyMemberVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
}

/// The first `node-<id>` DNS name of the end-entity certificate `cert`, unverified (the
/// verifier then checks the certificate for that name).
pub fn member_name_in(cert: &CertificateDer<'_>) -> Option<String> {
    let parsed = webpki::EndEntityCert::try_from(cert).ok()?;
    let name = parsed.valid_dns_names().find(|n| {
        n.strip_prefix("node-")
            .is_some_and(|id| id.parse::<u32>().is_ok())
    });
    name.map(str::to_string)
}

impl rustls::client::danger::ServerCertVerifier for AnyMemberVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let name = member_name_in(end_entity).ok_or(rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidForName,
        ))?;
        let name = ServerName::try_from(name).map_err(|_| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
        })?;
        self.inner
            .verify_server_cert(end_entity, intermediates, &name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Whether the end-entity certificate `cert` names `name` (a DNS subject alternative name;
/// the chain was already verified by the TLS handshake).
pub fn certificate_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(server_name) = ServerName::try_from(name) else {
        return false;
    };
    match rustls::server::ParsedCertificate::try_from(cert) {
        Ok(parsed) => rustls::client::verify_server_name(&parsed, &server_name).is_ok(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_ca_certificates_name_their_member_only() {
        // A generated node certificate names node-<id> and its host, never another member.
        let dir = tempfile::tempdir().unwrap();
        let files = bmqctl::dev_ca::generate_dev_ca(
            dir.path(),
            &[(1, "127.0.0.1".into()), (2, "broker2".into())],
        )
        .unwrap();
        let tls1 = &files.nodes[0].1;
        let cert1 = &load_certs(&tls1.cert_file, "certificate").unwrap()[0];
        assert!(certificate_names(cert1, "node-1"));
        assert!(!certificate_names(cert1, "node-2"));
        let cert2 = &load_certs(&files.nodes[1].1.cert_file, "certificate").unwrap()[0];
        assert!(certificate_names(cert2, "broker2"));
        assert!(!certificate_names(cert2, "node-1"));
        assert_eq!(member_name_in(cert1).as_deref(), Some("node-1"));
        assert_eq!(member_name_in(cert2).as_deref(), Some("node-2"));
        PeerTls::load(tls1).expect("generated files load");
    }
}
