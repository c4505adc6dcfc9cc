//! How every llmq program connects to NATS: credentials from the URL
//! (`nats://user:password@host:4222`, or `nats://token@host:4222`), replies and streams in the
//! user's own inboxes (`_INBOX.<user>`, which a server with per-user permissions lets only that
//! user read), and TLS when the URL says `tls://` or a CA file is given (the server's
//! certificate is checked against it).

use std::path::Path;

/// A URL taken apart: the server's address without credentials, and the credentials.
struct Url<'a> {
    address: String,
    user: Option<&'a str>,
    password: Option<&'a str>,
}

fn parse(url: &str) -> Url<'_> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("nats", url));
    match rest.rsplit_once('@') {
        Some((creds, host)) => {
            let (user, password) = match creds.split_once(':') {
                Some((u, p)) => (Some(u).filter(|u| !u.is_empty()), Some(p)),
                None => (None, Some(creds)),
            };
            Url {
                address: format!("{scheme}://{host}"),
                user,
                password,
            }
        }
        None => Url {
            address: url.to_string(),
            user: None,
            password: None,
        },
    }
}

/// The inbox prefix for a URL: `_INBOX.<user>` when it names a user, else `_INBOX`.
pub fn inbox_prefix(url: &str) -> String {
    match parse(url).user {
        Some(user) => format!("_INBOX.{}", crate::subjects::token(user)),
        None => "_INBOX".to_string(),
    }
}

/// The options to connect to `url` as `name` (shown in the server's connection list), and the
/// address to connect to.
pub fn options(
    url: &str,
    ca_file: Option<&Path>,
    name: &str,
) -> (async_nats::ConnectOptions, String) {
    let u = parse(url);
    let mut opts = match (u.user, u.password) {
        (Some(user), password) => async_nats::ConnectOptions::with_user_and_password(
            user.into(),
            password.unwrap_or_default().into(),
        ),
        (None, Some(token)) => async_nats::ConnectOptions::with_token(token.into()),
        (None, None) => async_nats::ConnectOptions::new(),
    };
    opts = opts.name(name).custom_inbox_prefix(inbox_prefix(url));
    if let Some(ca) = ca_file {
        opts = opts
            .add_root_certificates(ca.to_path_buf())
            .require_tls(true);
    }
    (opts, u.address)
}

/// Connects to `url` as `name`.
pub async fn connect(
    url: &str,
    ca_file: Option<&Path>,
    name: &str,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let (opts, address) = options(url, ca_file, name);
    opts.connect(address).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_address_and_name_the_inbox() {
        let u = parse("nats://client1:secret@nats:4222");
        assert_eq!(
            (u.address.as_str(), u.user, u.password),
            ("nats://nats:4222", Some("client1"), Some("secret"))
        );
        let u = parse("tls://worker:p@ss@nats:4222");
        assert_eq!(
            (u.address.as_str(), u.user, u.password),
            ("tls://nats:4222", Some("worker"), Some("p@ss"))
        );
        let u = parse("nats://s3cr3t@h:1");
        assert_eq!(
            (u.address.as_str(), u.user, u.password),
            ("nats://h:1", None, Some("s3cr3t"))
        );
        assert_eq!(
            parse("nats://127.0.0.1:4222").address,
            "nats://127.0.0.1:4222"
        );
        assert_eq!(
            inbox_prefix("nats://client1:secret@nats:4222"),
            "_INBOX.client1"
        );
        assert_eq!(inbox_prefix("nats://127.0.0.1:4222"), "_INBOX");
        assert_eq!(inbox_prefix("nats://s3cr3t@h:1"), "_INBOX");
    }
}
