//! Chat templates: renders a conversation into a prompt string with the model's Jinja
//! template, with the semantics of transformers' `apply_chat_template`, on minijinja.
//!
//! transformers renders with `trim_blocks` and `lstrip_blocks`, no autoescaping, its own
//! `tojson` (no HTML escaping, `ensure_ascii=False`, Python's separators), and the globals
//! `raise_exception` and `strftime_now`; Python string/dict methods (`.startswith`, `.strip`,
//! `.items()`...) come from minijinja-contrib's pycompat. All of that is reproduced here,
//! because a prompt that differs by one space from what the model was trained on degrades it.

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::{Result, TokenizerError};

/// One message of a conversation, as the OpenAI API sends it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `null` (an assistant turn that only calls tools) renders as the empty string.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Every other field (`tool_calls`, `reasoning_content`, `name`, `tool_call_id`...),
    /// handed to the template unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// A part of a multi-part content; only `{"type": "text", "text": ...}` can be rendered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            extra: Default::default(),
        }
    }

    /// The content as one string: text parts joined with `\n` (what vLLM does for text-only
    /// models), so templates that expect `message.content` to be a string always get one.
    fn content_text(&self, index: usize) -> Result<String> {
        match &self.content {
            None => Ok(String::new()),
            Some(MessageContent::Text(s)) => Ok(s.clone()),
            Some(MessageContent::Parts(parts)) => {
                let texts = parts
                    .iter()
                    .map(|p| match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => Ok(t.as_str()),
                        _ => Err(TokenizerError::UnsupportedContentPart {
                            index,
                            kind: p.kind.clone(),
                        }),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(texts.join("\n"))
            }
        }
    }
}

/// What a render needs besides the messages.
#[derive(Clone, Debug, Default)]
pub struct TemplateArgs {
    /// End the prompt with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Tool (function) schemas; `None` renders as Jinja `none`, as in transformers.
    pub tools: Option<Vec<serde_json::Value>>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking: false`). They
    /// may override `bos_token`/`eos_token` but not `messages`, `tools` or `add_generation_prompt`.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template (or a model's set of named ones) with its special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    default_name: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// Name transformers picks when tools are given and the model has such a template.
const TOOL_USE: &str = "tool_use";

impl ChatTemplate {
    /// Compiles one template.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        ChatTemplate::named(vec![("default".to_string(), source.to_string())])
    }

    /// Compiles a model's named templates (tokenizer_config's list form). As in transformers,
    /// `tool_use` is used when tools are given, `default` otherwise (or the only one).
    pub fn named(templates: Vec<(String, String)>) -> Result<ChatTemplate> {
        let default_name = match templates.iter().find(|(n, _)| n == "default") {
            Some((n, _)) => n.clone(),
            None if templates.len() == 1 => templates[0].0.clone(),
            None => {
                return Err(TokenizerError::TemplateInvalid(
                    "several chat templates and none named `default`".into(),
                ))
            }
        };
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("default delimiters are valid"),
        );
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            env.add_template_owned(name.clone(), source)
                .map_err(|e| TokenizerError::TemplateInvalid(describe(&e)))?;
            names.push(name);
        }
        Ok(ChatTemplate {
            env,
            names,
            default_name,
            bos_token: None,
            eos_token: None,
        })
    }

    /// Sets the `bos_token` / `eos_token` template variables (left undefined when `None`).
    pub fn with_special_tokens(
        mut self,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> ChatTemplate {
        self.bos_token = bos_token;
        self.eos_token = eos_token;
        self
    }

    /// The prompt for `messages`. A template's `raise_exception` becomes
    /// [`TokenizerError::TemplateRaised`] with its message; other failures
    /// [`TokenizerError::Template`] with minijinja's description and line.
    pub fn render(&self, messages: &[ChatMessage], args: &TemplateArgs) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(t) = token {
                ctx.insert(key.to_string(), t.clone().into());
            }
        }
        ctx.extend(args.kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut obj = serde_json::Map::new();
                obj.insert("role".into(), m.role.clone().into());
                obj.insert("content".into(), m.content_text(i)?.into());
                obj.extend(m.extra.iter().map(|(k, v)| (k.clone(), v.clone())));
                Ok(serde_json::Value::Object(obj))
            })
            .collect::<Result<Vec<_>>>()?;
        ctx.insert("messages".into(), messages.into());
        ctx.insert(
            "tools".into(),
            args.tools
                .clone()
                .map_or(serde_json::Value::Null, serde_json::Value::from),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            args.add_generation_prompt.into(),
        );

        let name = if args.tools.is_some() && self.names.iter().any(|n| n == TOOL_USE) {
            TOOL_USE
        } else {
            &self.default_name
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TokenizerError::Template(describe(&e)))?;
        template
            .render(Value::from(Serde(&ctx)))
            .map_err(|e| match raised_message(&e) {
                Some(msg) => TokenizerError::TemplateRaised(msg),
                None => TokenizerError::Template(describe(&e)),
            })
    }
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// minijinja's message (kind, detail, template line) plus its causes.
fn describe(e: &Error) -> String {
    let mut out = match (e.detail(), e.line()) {
        (Some(detail), Some(line)) => format!(
            "{}: {detail} (template `{}`, line {line})",
            e.kind(),
            e.name().unwrap_or("?")
        ),
        _ => e.to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The payload of `raise_exception`, carried as the error's source so it survives minijinja
/// adding template locations.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raised_message(e: &Error) -> Option<String> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        source = s.source();
    }
    None
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// transformers' `strftime_now`: the current time formatted with a strftime pattern. We use
/// UTC (servers run in UTC); supported: %Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%.
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(secs as i64, &format)
}

fn strftime(unix_secs: i64, format: &str) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOperation,
                "strftime_now: format ends with `%`",
            )
        })?;
        let piece = match spec {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", (hour + 11) % 12 + 1),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'b' => MONTHS[month as usize - 1][..3].to_string(),
            'B' => MONTHS[month as usize - 1].to_string(),
            'a' => DAYS[weekday][..3].to_string(),
            'A' => DAYS[weekday].to_string(),
            'j' => format!("{day_of_year:03}"),
            '%' => "%".to_string(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive `%{other}`"),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Howard Hinnant's civil_from_days: proleptic Gregorian (year, month, day) of a day count
/// since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, i.e. Python's spacing (`, ` and `: `, or `,` plus newlines when
/// indented) and no HTML escaping, unlike Jinja's and minijinja's built-in filter.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        None => (
            (if indent.is_some() { "," } else { ", " }).to_string(),
            ": ".to_string(),
        ),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
    };
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let style = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&mut out, &json, 0);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting options.
struct PyJson {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, v: &serde_json::Value, level: usize) {
        match v {
            serde_json::Value::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, item, level + 1);
                }
                self.newline(out, level);
                out.push(']');
            }
            serde_json::Value::Object(map) if !map.is_empty() => {
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.string(out, k);
                    out.push_str(&self.key_sep);
                    self.write(out, item, level + 1);
                }
                self.newline(out, level);
                out.push('}');
            }
            serde_json::Value::String(s) => self.string(out, s),
            // Scalars and empty containers print the same in serde_json and Python.
            other => out.push_str(&other.to_string()),
        }
    }

    fn newline(&self, out: &mut String, level: usize) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn string(&self, out: &mut String, s: &str) {
        // serde_json escapes exactly what Python escapes with ensure_ascii=False.
        let quoted = serde_json::Value::from(s).to_string();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage], args: &TemplateArgs) -> Result<String> {
        ChatTemplate::new(source)?
            .with_special_tokens(Some("<s>".into()), Some("</s>".into()))
            .render(messages, args)
    }

    #[test]
    fn embedded_chatml_template() {
        let tok = super::super::Tokenizer::embedded();
        let msgs = [
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Hi"),
        ];
        let args = TemplateArgs {
            add_generation_prompt: true,
            ..Default::default()
        };
        assert_eq!(tok.apply_chat_template(&msgs, &args).unwrap(), "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        let args = TemplateArgs::default();
        assert_eq!(
            tok.apply_chat_template(&msgs[1..], &args).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn variables_and_whitespace_follow_transformers() {
        // trim_blocks + lstrip_blocks: block lines leave no whitespace behind.
        let src = "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}{{ eos_token }}";
        let msgs = [
            ChatMessage::text("user", "a"),
            ChatMessage::text("assistant", "b"),
        ];
        let out = render(
            src,
            &msgs,
            &TemplateArgs {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(out, "<s>\n[a]\n></s>");
    }

    #[test]
    fn pycompat_methods_and_namespace() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if m.content.startswith('x') %}{% set ns.n = ns.n + 1 %}{% endif %}{% endfor %}{{ ns.n }}|{{ messages[0].content.strip().upper() }}|{% for k, v in extra.items() %}{{ k }}={{ v }}{% endfor %}|{{ 'a,b'.split(',') | length }}";
        let msgs = [
            ChatMessage::text("user", " xy "),
            ChatMessage::text("user", "xz"),
        ];
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("extra".into(), serde_json::json!({"k": 1}));
        let out = render(
            src,
            &msgs,
            &TemplateArgs {
                kwargs,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(out, "1|XY|k=1|2");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let src = "{{ tools[0] | tojson }}\n{{ tools[0] | tojson(indent=2) }}\n{{ tools[0] | tojson(ensure_ascii=true, sort_keys=true) }}";
        let tool = serde_json::json!({"name": "f<x>", "parameters": {"type": "object", "required": [], "p": [1, 2.5, null, true]}, "d": "é\n🦀"});
        let out = render(
            src,
            &[],
            &TemplateArgs {
                tools: Some(vec![tool]),
                ..Default::default()
            },
        )
        .unwrap();
        // Expected strings from Python 3: json.dumps(tool, ensure_ascii=False), json.dumps(tool,
        // ensure_ascii=False, indent=2), json.dumps(tool, ensure_ascii=True, sort_keys=True).
        let expected = [
            r#"{"name": "f<x>", "parameters": {"type": "object", "required": [], "p": [1, 2.5, null, true]}, "d": "é\n🦀"}"#,
            "{\n  \"name\": \"f<x>\",\n  \"parameters\": {\n    \"type\": \"object\",\n    \"required\": [],\n    \"p\": [\n      1,\n      2.5,\n      null,\n      true\n    ]\n  },\n  \"d\": \"é\\n🦀\"\n}",
            r#"{"d": "\u00e9\n\ud83e\udd80", "name": "f<x>", "parameters": {"p": [1, 2.5, null, true], "required": [], "type": "object"}}"#,
        ];
        assert_eq!(out, expected.join("\n"));
    }

    #[test]
    fn content_parts_and_null_content() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
        ]))
        .unwrap();
        let src = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}{% endif %};{% endfor %}";
        assert_eq!(
            render(src, &msgs, &TemplateArgs::default()).unwrap(),
            "user:a\nb;assistant:f;"
        );

        let image: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]))
        .unwrap();
        let err = render(src, &image, &TemplateArgs::default()).unwrap_err();
        assert!(
            matches!(err, TokenizerError::UnsupportedContentPart { index: 0, ref kind } if kind == "image_url"),
            "{err}"
        );
    }

    #[test]
    fn template_errors_are_clear() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok";
        let err = render(
            src,
            &[ChatMessage::text("assistant", "x")],
            &TemplateArgs::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateRaised(ref m) if m == "Conversation must start with user"),
            "{err:?}"
        );
        assert_eq!(
            render(
                src,
                &[ChatMessage::text("user", "x")],
                &TemplateArgs::default()
            )
            .unwrap(),
            "ok"
        );

        let err = ChatTemplate::new("{% for %}").unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateInvalid(_)), "{err:?}");
        let err = render(
            "{{ messages | nosuchfilter }}",
            &[],
            &TemplateArgs::default(),
        )
        .unwrap_err();
        // minijinja finds unknown filters when rendering, not when compiling.
        assert!(
            matches!(err, TokenizerError::Template(ref m) if m.contains("nosuchfilter")),
            "{err}"
        );
        let err = render("{{ 1 + messages }}", &[], &TemplateArgs::default()).unwrap_err();
        assert!(
            matches!(err, TokenizerError::Template(ref m) if m.contains("line 1") && m.contains("+ operator")),
            "{err}"
        );
    }

    #[test]
    fn named_templates_need_a_default() {
        let two = vec![
            ("a".to_string(), "A".to_string()),
            ("b".to_string(), "B".to_string()),
        ];
        assert!(matches!(
            ChatTemplate::named(two),
            Err(TokenizerError::TemplateInvalid(_))
        ));
        let one = ChatTemplate::named(vec![("rag".to_string(), "R".to_string())]).unwrap();
        assert_eq!(one.render(&[], &TemplateArgs::default()).unwrap(), "R");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29T13:05:09Z was a Thursday, day 60 of the year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime(t, "%d %b %Y|%A %a|%H:%M:%S %I%p|%j|%y-%m-%e|%B|%%").unwrap(),
            "29 Feb 2024|Thursday Thu|13:05:09 01PM|060|24-02-29|February|%"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        assert!(strftime(0, "%Q").is_err());
        assert!(strftime_now("%Y".into()).unwrap().len() == 4);
    }
}
