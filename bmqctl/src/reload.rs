//! `bmqctl admin reload --admin HOST:PORT [--json]`: the node reads its configuration file
//! again (`POST /admin/reload`) and applies what can change while it runs — client tokens,
//! the admin token, the TLS certificate, key and CA, the log level — and names what needs a
//! restart. Prints what changed (`--json`: the node's answer as it came); a refused file
//! (unreadable or invalid: nothing changed) prints the loader's error and exits non-zero.

use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use bmq_proto::admin_doc::ReloadDoc;
use clap::Args;

use crate::admin::AdminTarget;

/// `bmqctl admin reload`.
#[derive(Debug, Args)]
pub struct ReloadArgs {
    /// Print the node's JSON answer instead of text.
    #[arg(long)]
    pub json: bool,
    /// The node to reload.
    #[command(flatten)]
    pub target: AdminTarget,
}

/// Asks the node to reload and prints its answer.
///
/// Errors: no answer within the timeout, a refused admin token (401), or a refused reload
/// (after printing it).
pub async fn run(args: &ReloadArgs) -> anyhow::Result<()> {
    let target = &args.target;
    let token = crate::admin::admin_token(target);
    let timeout = Duration::from_millis(target.timeout_ms);
    let (code, body) = tokio::time::timeout(
        timeout,
        crate::http::request_with_status(&target.admin, "POST", "/admin/reload", token.as_deref()),
    )
    .await
    .map_err(|_| {
        anyhow!(
            "no answer from {} within {} ms",
            target.admin,
            timeout.as_millis()
        )
    })??;
    if code != 200 && code != 400 {
        bail!(
            "{} answered {code}: {}",
            target.admin,
            String::from_utf8_lossy(&body).trim()
        );
    }
    let doc: ReloadDoc = serde_json::from_slice(&body)
        .with_context(|| format!("{} answered {code} without a reload document", target.admin))?;
    if args.json {
        outln!("{}", String::from_utf8_lossy(&body).trim());
    } else {
        out!("{}", render(&doc));
    }
    if doc.result == "refused" {
        bail!(
            "node {}: the reload was refused; nothing changed",
            doc.node_id
        );
    }
    Ok(())
}

/// The text `bmqctl admin reload` prints for `doc`.
pub fn render(doc: &ReloadDoc) -> String {
    let mut out = String::new();
    let head = match doc.result.as_str() {
        "applied" => "configuration reloaded",
        "unchanged" => "configuration reloaded; nothing to change",
        _ => "configuration reload refused; nothing changed",
    };
    out.push_str(&format!(
        "node {}: {head} ({}, requested by {})\n",
        doc.node_id, doc.file, doc.requested_by
    ));
    if let Some(error) = &doc.error {
        out.push_str(&format!("  error: {error}\n"));
    }
    for c in &doc.changed {
        let before = c.before.as_deref().unwrap_or("(none)");
        let after = c.after.as_deref().unwrap_or("(none)");
        out.push_str(&format!("  changed {}: {before} -> {after}\n", c.setting));
    }
    if doc.sessions_closed > 0 {
        out.push_str(&format!(
            "  client sessions closed (NOT_AUTHORIZED): {}\n",
            doc.sessions_closed
        ));
    }
    if !doc.needs_restart.is_empty() {
        out.push_str(&format!(
            "  needs a restart (not applied): {}\n",
            doc.needs_restart.join(", ")
        ));
    }
    if !doc.seed_only.is_empty() {
        out.push_str(&format!(
            "  cluster state, seeded by the file at the first start only (not applied; use \
             bmqctl admin add-member/remove-member, bmqctl domain): {}\n",
            doc.seed_only.join(", ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use bmq_proto::admin_doc::{ReloadDoc, SettingChangeDoc};

    #[test]
    fn the_text_names_changes_restarts_and_refusals() {
        // What an operator reads: each change, the closed sessions, what was not applied.
        let mut doc = ReloadDoc {
            node_id: 2,
            result: "applied".into(),
            requested_by: "admin.token".into(),
            file: "/etc/bmq/node-2.toml".into(),
            at_unix_ms: 1,
            changed: vec![SettingChangeDoc {
                setting: "auth.tokens[orders]".into(),
                before: None,
                after: Some("secret sha256:0123456789ab, permissions [produce]".into()),
            }],
            needs_restart: vec!["partition_count".into()],
            seed_only: vec!["domains".into()],
            sessions_closed: 1,
            error: None,
            error_field: None,
        };
        let text = super::render(&doc);
        assert!(
            text.contains(
                "node 2: configuration reloaded (/etc/bmq/node-2.toml, requested by admin.token)"
            ),
            "{text}"
        );
        assert!(
            text.contains("changed auth.tokens[orders]: (none) -> secret sha256:0123456789ab"),
            "{text}"
        );
        assert!(
            text.contains("sessions closed (NOT_AUTHORIZED): 1"),
            "{text}"
        );
        assert!(
            text.contains("needs a restart (not applied): partition_count\n"),
            "{text}"
        );
        assert!(
            text.contains("first start only (not applied; use bmqctl admin add-member/remove-member, bmqctl domain): domains"),
            "{text}"
        );
        doc.result = "refused".into();
        doc.changed.clear();
        doc.error = Some("invalid configuration x: auth.tokens[0].secret: too short".into());
        let text = super::render(&doc);
        assert!(text.contains("refused; nothing changed"), "{text}");
        assert!(text.contains("auth.tokens[0].secret"), "{text}");
    }
}
