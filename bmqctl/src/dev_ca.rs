//! The development CA of a local cluster (rcgen): `bmqctl cluster up` writes a CA and one
//! certificate and key per node, so the cluster runs mutual TLS between nodes and TLS for
//! clients without any setup. In production bring your own CA (README "Security").

use std::path::{Path, PathBuf};

use bmq_config::TlsSettings;
use bmq_proto::{member_name, NodeId};

/// The files [`generate_dev_ca`] wrote.
#[derive(Debug, Clone)]
pub struct DevCaFiles {
    /// The CA certificate (clients pass it as `--tls-ca`).
    pub ca_cert: PathBuf,
    /// Per node id: its [`TlsSettings`].
    pub nodes: Vec<(u32, TlsSettings)>,
}

/// Writes a development CA and one certificate and key per node into `dir`:
/// `ca.pem`, `ca-key.pem`, `node-<id>.pem`, `node-<id>-key.pem` (keys mode 0600). Each node
/// certificate names `node-<id>`, the member's `host`, `localhost` and `127.0.0.1`. Every call
/// makes a new CA (clients read `ca.pem` again when they start).
///
/// `members`: `(id, host)` of every node. Errors: an I/O error naming the file, or an rcgen
/// error.
pub fn generate_dev_ca(dir: &Path, members: &[(u32, String)]) -> anyhow::Result<DevCaFiles> {
    use anyhow::Context as _;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let ca_path = dir.join("ca.pem");
    let ca_key_path = dir.join("ca-key.pem");
    let ca_key = rcgen::KeyPair::generate()?;
    let ca_cert = ca_params()?.self_signed(&ca_key)?;
    write_file(&ca_path, ca_cert.pem().as_bytes(), false)?;
    write_file(&ca_key_path, ca_key.serialize_pem().as_bytes(), true)?;
    let mut nodes = Vec::new();
    for (id, host) in members {
        nodes.push((*id, node_cert(dir, &ca_cert, &ca_key, *id, host)?));
    }
    Ok(DevCaFiles {
        ca_cert: ca_path,
        nodes,
    })
}

/// Issues a certificate and key for node `id` (at `host`) under the development CA already in
/// `dir` (`ca-key.pem`), for a node added to a running local cluster; writes
/// `node-<id>.pem` and `node-<id>-key.pem` there as [`generate_dev_ca`] does.
///
/// Errors: no CA key in `dir` (the cluster runs without security), an I/O or rcgen error.
pub fn issue_node_cert(dir: &Path, id: u32, host: &str) -> anyhow::Result<TlsSettings> {
    use anyhow::Context as _;
    let key_path = dir.join("ca-key.pem");
    let pem = std::fs::read_to_string(&key_path)
        .with_context(|| format!("cannot read the development CA key {}", key_path.display()))?;
    let ca_key = rcgen::KeyPair::from_pem(&pem)?;
    // The same subject and key as the CA certificate on disk: what it issues chains to it.
    let ca_cert = ca_params()?.self_signed(&ca_key)?;
    node_cert(dir, &ca_cert, &ca_key, id, host)
}

/// The development CA's certificate parameters.
fn ca_params() -> anyhow::Result<rcgen::CertificateParams> {
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyUsagePurpose,
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "bmq development CA");
    ca_params.distinguished_name = dn;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(ca_params)
}

/// One node's certificate (naming `node-<id>`, `host`, `localhost`, `127.0.0.1`) and key,
/// written into `dir`.
fn node_cert(
    dir: &Path,
    ca_cert: &rcgen::Certificate,
    ca_key: &rcgen::KeyPair,
    id: u32,
    host: &str,
) -> anyhow::Result<TlsSettings> {
    use rcgen::{
        CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
        KeyUsagePurpose,
    };
    let mut names = vec![
        member_name(NodeId(id)),
        "localhost".to_string(),
        "127.0.0.1".to_string(),
    ];
    if !names.iter().any(|n| n == host) {
        names.push(host.to_string());
    }
    let mut params = CertificateParams::new(names)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, member_name(NodeId(id)));
    params.distinguished_name = dn;
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, ca_cert, ca_key)?;
    let cert_file = dir.join(format!("{}.pem", member_name(NodeId(id))));
    let key_file = dir.join(format!("{}-key.pem", member_name(NodeId(id))));
    write_file(&cert_file, cert.pem().as_bytes(), false)?;
    write_file(&key_file, key.serialize_pem().as_bytes(), true)?;
    Ok(TlsSettings {
        ca_file: dir.join("ca.pem"),
        cert_file,
        key_file,
        client_listener: true,
    })
}

/// Writes `bytes` to `path`, mode 0600 when `secret`.
pub fn write_file(path: &Path, bytes: &[u8], secret: bool) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if secret {
        options.mode(0o600);
    }
    let mut f = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
