//! `POST /admin/reload`: the node reads its configuration file again and applies what can
//! change while it runs ([`crate::reload`]). Behind the admin token like every admin action;
//! the token's name is who asked, in the log and the answer.
//!
//! Answers: 200 with a [`bmq_proto::admin_doc::ReloadDoc`] (JSON) when the file was read and
//! valid (`result` is `applied` or `unchanged`, and `needs_restart` names what was not
//! applied); 400 with the same document (`result` `refused`, `error`, `error_field`) when it
//! was not, nothing changed; 401 without a valid admin token.

use actix_web::{web, HttpRequest, HttpResponse};
use tracing::info;

use crate::admin::{admin_caller, AdminContext};

/// The handler of `POST /admin/reload`.
pub async fn reload(ctx: web::Data<AdminContext>, req: HttpRequest) -> HttpResponse {
    let requested_by = match admin_caller(&ctx, &req) {
        Ok(who) => who,
        Err(refused) => return *refused,
    };
    let remote = req.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    info!(%remote, %requested_by, "configuration reload requested");
    let reloader = ctx.reload.clone();
    // File reads, off the server's thread.
    match web::block(move || reloader.reload(&requested_by)).await {
        Ok(doc) if doc.result == "refused" => HttpResponse::BadRequest().json(doc),
        Ok(doc) => HttpResponse::Ok().json(doc),
        Err(e) => HttpResponse::ServiceUnavailable().body(format!("reload did not run: {e}\n")),
    }
}
