//! TLS and token options of the client commands (`bmqctl produce`, `bmqctl consume`).
//!
//! Resolution, first match wins:
//! - CA certificate: `--tls-ca`, else `$BMQ_TLS_CA`, else `CLUSTER_DIR/security/ca.pem` when
//!   that file exists; `--no-tls` forces plain TCP.
//! - Token: `--token`, else `$BMQ_TOKEN`, else the contents of
//!   `CLUSTER_DIR/security/client.token` when that file exists.
//!
//! `CLUSTER_DIR` is `$BMQ_CLUSTER_DIR`, else `.cluster` (the default directory of
//! `bmqctl cluster up`), so a newcomer's `bmqctl produce` next to `bmqctl cluster up` finds the
//! local cluster's development CA and token without any flag.

use std::path::{Path, PathBuf};

use anyhow::Context;

use bmq_client::ClientConfig;

/// Directory (under the cluster directory) where `bmqctl cluster up` writes the development
/// CA, the node certificates and the tokens.
pub const SECURITY_DIR: &str = "security";
/// File name of the development CA certificate in [`SECURITY_DIR`].
pub const CA_FILE: &str = "ca.pem";
/// File name of the local cluster's client token in [`SECURITY_DIR`].
pub const CLIENT_TOKEN_FILE: &str = "client.token";
/// File name of the local cluster's admin token in [`SECURITY_DIR`].
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// TLS and token flags shared by the client commands.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClientSecurityArgs {
    /// PEM file of the CA that signed the brokers' certificates; enables TLS
    /// [default: $BMQ_TLS_CA, else CLUSTER_DIR/security/ca.pem if it exists; CLUSTER_DIR is
    /// $BMQ_CLUSTER_DIR, else .cluster].
    #[arg(long = "tls-ca", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// Speak plain TCP even if a CA is found.
    #[arg(long)]
    pub no_tls: bool,
    /// Client token (an [[auth.tokens]] secret of the cluster)
    /// [default: $BMQ_TOKEN, else the contents of CLUSTER_DIR/security/client.token].
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
}

/// The cluster directory whose `security/` files are used by default: `$BMQ_CLUSTER_DIR`,
/// else `.cluster`.
pub fn cluster_dir() -> PathBuf {
    std::env::var_os("BMQ_CLUSTER_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cluster"))
}

impl ClientSecurityArgs {
    /// Applies the resolved CA and token to `config` (see the module doc), looking for the
    /// default files under `cluster_dir`.
    ///
    /// Errors: a token file that exists but cannot be read.
    pub fn apply(&self, config: &mut ClientConfig, cluster_dir: &Path) -> anyhow::Result<()> {
        let security = cluster_dir.join(SECURITY_DIR);
        config.tls_ca_file = if self.no_tls {
            None
        } else {
            self.tls_ca
                .clone()
                .or_else(|| {
                    std::env::var_os("BMQ_TLS_CA")
                        .filter(|v| !v.is_empty())
                        .map(PathBuf::from)
                })
                .or_else(|| Some(security.join(CA_FILE)).filter(|p| p.is_file()))
        };
        config.token = match self
            .token
            .clone()
            .or_else(|| std::env::var("BMQ_TOKEN").ok().filter(|v| !v.is_empty()))
        {
            Some(t) => Some(t),
            None => {
                let file = security.join(CLIENT_TOKEN_FILE);
                if file.is_file() {
                    let text = std::fs::read_to_string(&file)
                        .with_context(|| format!("cannot read the token {}", file.display()))?;
                    Some(text.trim().to_string()).filter(|t| !t.is_empty())
                } else {
                    None
                }
            }
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_and_cluster_files_are_the_fallback() {
        // Flags override; without them the cluster directory's CA and token are used.
        let dir = tempfile::tempdir().unwrap();
        let mut config = ClientConfig::new(vec!["127.0.0.1:1".into()]);
        ClientSecurityArgs::default()
            .apply(&mut config, dir.path())
            .unwrap();
        // No files and (in this test process) no env vars set by us: plain, anonymous,
        // unless the environment sets them.
        if std::env::var_os("BMQ_TLS_CA").is_none() {
            assert_eq!(config.tls_ca_file, None);
        }
        let sec = dir.path().join(SECURITY_DIR);
        std::fs::create_dir_all(&sec).unwrap();
        std::fs::write(sec.join(CA_FILE), "x").unwrap();
        std::fs::write(sec.join(CLIENT_TOKEN_FILE), "tok-from-file\n").unwrap();
        ClientSecurityArgs::default()
            .apply(&mut config, dir.path())
            .unwrap();
        if std::env::var_os("BMQ_TLS_CA").is_none() {
            assert_eq!(config.tls_ca_file, Some(sec.join(CA_FILE)));
        }
        if std::env::var_os("BMQ_TOKEN").is_none() {
            assert_eq!(config.token.as_deref(), Some("tok-from-file"));
        }
        let args = ClientSecurityArgs {
            tls_ca: Some("/x/ca.pem".into()),
            no_tls: false,
            token: Some("flag".into()),
        };
        args.apply(&mut config, dir.path()).unwrap();
        assert_eq!(config.tls_ca_file, Some(PathBuf::from("/x/ca.pem")));
        assert_eq!(config.token.as_deref(), Some("flag"));
        let args = ClientSecurityArgs {
            no_tls: true,
            ..args
        };
        args.apply(&mut config, dir.path()).unwrap();
        assert_eq!(config.tls_ca_file, None);
    }
}
