//! Scrape a `/metrics` endpoint and read the Prometheus text format
//! (version 0.0.4) into samples: comments skipped, label values unescaped,
//! every sample line checked to be well formed.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Series name (with `_total`, `_count`, ... as exposed).
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// The samples of one scrape, and the declared type of each family.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    /// Every sample, in order.
    pub samples: Vec<Sample>,
    /// `# TYPE` of each family.
    pub types: BTreeMap<String, String>,
}

impl Exposition {
    /// The samples of `name` whose labels include every pair of `labels`.
    pub fn find<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |sample| {
            sample.name == name
                && labels
                    .iter()
                    .all(|(key, value)| sample.labels.get(*key).map(String::as_str) == Some(*value))
        })
    }

    /// The sum of the samples [`Exposition::find`] finds (0 when none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.find(name, labels).map(|sample| sample.value).sum()
    }

    /// The value of the one sample [`Exposition::find`] finds.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
        let found: Vec<_> = self.find(name, labels).collect();
        match found.as_slice() {
            [sample] => Ok(sample.value),
            [] => bail!("no sample {name} {labels:?}"),
            _ => bail!("{} samples {name} {labels:?}", found.len()),
        }
    }
}

/// Read a Prometheus text exposition.
pub fn parse(text: &str) -> anyhow::Result<Exposition> {
    let mut exposition = Exposition::default();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                bail!("bad TYPE line {line:?}");
            };
            exposition.types.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        exposition
            .samples
            .push(parse_sample(line).with_context(|| format!("bad sample line {line:?}"))?);
    }
    Ok(exposition)
}

fn parse_sample(line: &str) -> anyhow::Result<Sample> {
    let name_end = line.find(['{', ' ']).context("no value")?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        bail!("bad name {name:?}");
    }
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        let end = loop {
            // A key, `=`, a quoted value, then `,` or `}`.
            let Some(&(start, first)) = chars.peek() else {
                bail!("unterminated labels");
            };
            if first == '}' {
                break start + 1;
            }
            let mut key = String::new();
            for (_, c) in chars.by_ref() {
                if c == '=' {
                    break;
                }
                key.push(c);
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                bail!("label {key} without a quoted value");
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => bail!("unterminated escape"),
                    },
                    Some((_, '"')) => break,
                    Some((_, c)) => value.push(c),
                    None => bail!("unterminated label value"),
                }
            }
            labels.insert(key, value);
            match chars.next() {
                Some((_, ',')) => continue,
                Some((index, '}')) => break index + 1,
                other => bail!("unexpected {other:?} after a label"),
            }
        };
        rest = &after[end..];
    }
    let value_text = rest.split_whitespace().next().context("no value")?;
    let value = match value_text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        text => text
            .parse()
            .with_context(|| format!("bad value {text:?}"))?,
    };
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// `GET /metrics` at `address`, parsed; an error unless the answer is 200
/// in the Prometheus text format.
pub async fn scrape(address: SocketAddr) -> anyhow::Result<Exposition> {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .with_context(|| format!("connect to {address}"))?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nAccept: text/plain\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no end of headers")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("scrape of {address}: {head}");
    }
    if !head.contains("text/plain; version=0.0.4") {
        bail!("not the Prometheus text format: {head}");
    }
    parse(body)
}

#[test]
fn the_parser_reads_labels_escapes_and_special_values() {
    let text = "# HELP a_total A.\n# TYPE a_total counter\n\
                a_total{x=\"1\",y=\"q\\\"uote\\\\d\"} 12\n\
                b 0.5\n\
                c_bucket{le=\"+Inf\"} 3\nd +Inf\n";
    let exposition = parse(text).expect("valid");
    assert_eq!(exposition.types["a_total"], "counter");
    assert_eq!(
        exposition
            .value("a_total", &[("y", "q\"uote\\d")])
            .expect("a"),
        12.0
    );
    assert_eq!(exposition.value("b", &[]).expect("b"), 0.5);
    assert_eq!(
        exposition.value("c_bucket", &[("le", "+Inf")]).expect("c"),
        3.0
    );
    assert!(exposition.value("d", &[]).expect("d").is_infinite());
    assert!(parse("a{x=\"1\" 2\n").is_err());
    assert!(parse("a{x=1} 2\n").is_err());
    assert!(parse("a two\n").is_err());
}
