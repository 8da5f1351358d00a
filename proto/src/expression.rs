//! Subscription expressions: BlazingMQ's expression language over message properties
//! (`bmqeval`, `bmqeval_simpleevaluatorparser.y` and `..scanner.l` of BlazingMQ), so that a
//! consumer's `Subscription.expression` means here what it means there.
//!
//! Grammar (lowest precedence first; `==`/`!=` and the orderings do not chain):
//!
//! ```text
//! expr :=  expr "||" expr  |  expr "&&" expr
//!       |  expr ("==" | "!=") expr  |  expr ("<" | "<=" | ">" | ">=") expr
//!       |  expr ("+" | "-") expr  |  expr ("*" | "/" | "%") expr
//!       |  ("!" | "~" | "-") expr  |  "(" expr ")"  |  "exists" "(" name ")"
//!       |  name  |  integer  |  "string"  |  "true"  |  "false"
//! name    := [a-zA-Z][a-zA-Z0-9_.]*          integer := -?[0-9]+ (64-bit)
//! string  := "..." (a backslash keeps the next character; escapes are not translated)
//! ```
//!
//! As BlazingMQ's scanner, an integer token takes a leading minus when a digit follows it, so
//! `x-1` is `x` then `-1` (a syntax error; write `x - 1`). Limits (BlazingMQ's): at most
//! [`EXPRESSION_LENGTH_MAX`] bytes, [`OPERATORS_MAX`] operators (each property reference,
//! comparison, boolean and arithmetic operation and unary operator counts one) and
//! [`PROPERTIES_MAX`] property references, at least one property. A comparison with the
//! literal `true` or `false` is the property itself or its negation.
//!
//! Evaluation: values are booleans, 64-bit integers (BOOL is boolean; CHAR, SHORT, INT32 and
//! INT64 are integers) and strings; a BINARY property, a missing property, a type mismatch
//! (a string compared with an integer, arithmetic on a boolean), a division by zero or a
//! result that is not a boolean make the expression false for that message, as BlazingMQ's
//! evaluator does. Arithmetic wraps on overflow.

use std::fmt;

use thiserror::Error;

/// Longest expression text, bytes (`k_MAX_EXPRESSION_LENGTH`).
pub const EXPRESSION_LENGTH_MAX: usize = 128;
/// Most operators in one expression (`k_MAX_OPERATORS`).
pub const OPERATORS_MAX: usize = 10;
/// Most property references in one expression (`k_MAX_PROPERTIES`).
pub const PROPERTIES_MAX: usize = 10;

/// Why an expression does not compile, with BlazingMQ's error codes (`bmqeval::ErrorType`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CompileError {
    /// Not an expression of the grammar (code -100), at a byte offset.
    #[error("syntax error: {message} at offset {offset}")]
    Syntax {
        /// What was found or expected.
        message: String,
        /// Byte offset of the token where the error was found.
        offset: usize,
    },
    /// The expression names no property (code -101).
    #[error("expression does not use any properties")]
    NoProperties,
    /// Too many operators or properties (code -102).
    #[error("{0}")]
    TooComplex(String),
    /// Longer than [`EXPRESSION_LENGTH_MAX`] (code -103).
    #[error("expression is too long ({0}), max allowed length: {EXPRESSION_LENGTH_MAX}")]
    TooLong(usize),
}

impl CompileError {
    /// BlazingMQ's error code (`bmqeval::ErrorType::Enum`).
    pub fn code(&self) -> i32 {
        match self {
            CompileError::Syntax { .. } => -100,
            CompileError::NoProperties => -101,
            CompileError::TooComplex(_) => -102,
            CompileError::TooLong(_) => -103,
        }
    }

    /// BlazingMQ's name for the error kind (`bmqeval::ErrorType::toAscii`).
    pub fn kind(&self) -> &'static str {
        match self {
            CompileError::Syntax { .. } => "SYNTAX",
            CompileError::NoProperties => "NO_PROPERTIES",
            CompileError::TooComplex(_) => "TOO_COMPLEX",
            CompileError::TooLong(_) => "TOO_LONG",
        }
    }
}

/// A property's value as the evaluator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// BOOL.
    Bool(bool),
    /// CHAR, SHORT, INT32, INT64.
    Int(i64),
    /// STRING.
    Str(&'a str),
}

/// Why a property cannot be read (the expression is then false for the message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// The message has no property of this name.
    Missing,
    /// The property's type cannot be compared (BINARY).
    Type,
}

/// Where an expression reads a message's properties from.
pub trait Properties {
    /// The property `name`.
    fn get(&self, name: &str) -> Result<Value<'_>, Unreadable>;
}

/// The properties of one of our messages (`Property`, typed by `PropertyType`; a value that
/// does not parse as its type, or BINARY, cannot be compared).
impl Properties for [crate::client::Property] {
    fn get(&self, name: &str) -> Result<Value<'_>, Unreadable> {
        use crate::client::PropertyType;
        let p = self
            .iter()
            .find(|p| p.key == name)
            .ok_or(Unreadable::Missing)?;
        match PropertyType::try_from(p.value_type).unwrap_or(PropertyType::String) {
            PropertyType::String => Ok(Value::Str(&p.value)),
            PropertyType::Bool => p
                .value
                .parse()
                .map(Value::Bool)
                .map_err(|_| Unreadable::Type),
            PropertyType::Char
            | PropertyType::Short
            | PropertyType::Int32
            | PropertyType::Int64 => p
                .value
                .parse()
                .map(Value::Int)
                .map_err(|_| Unreadable::Type),
            PropertyType::Binary => Err(Unreadable::Type),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BinOp {
    Or,
    And,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
    Mod,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Property(String),
    Exists(String),
    Int(i64),
    Str(String),
    Bool(bool),
    Not(Box<Node>),
    Neg(Box<Node>),
    Binary(BinOp, Box<Node>, Box<Node>),
}

/// A compiled subscription expression (see the module doc).
#[derive(Clone, PartialEq, Eq)]
pub struct Expression {
    text: String,
    root: Node,
}

impl fmt::Debug for Expression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Expression({:?})", self.text)
    }
}

impl Expression {
    /// Compiles `text`.
    ///
    /// Errors: [`CompileError`] with BlazingMQ's kind and a message naming the offset.
    pub fn compile(text: &str) -> Result<Expression, CompileError> {
        if text.len() > EXPRESSION_LENGTH_MAX {
            return Err(CompileError::TooLong(text.len()));
        }
        let tokens = scan(text)?;
        let mut parser = Parser {
            tokens,
            at: 0,
            operators: 0,
            properties: 0,
            end: text.len(),
        };
        let root = parser.expression(0)?;
        if let Some((token, offset)) = parser.tokens.get(parser.at) {
            return Err(CompileError::Syntax {
                message: format!("unexpected {token}, expecting end of expression"),
                offset: *offset,
            });
        }
        if parser.operators > OPERATORS_MAX {
            return Err(CompileError::TooComplex(format!(
                "too many operators ({}), max allowed operators: {OPERATORS_MAX}",
                parser.operators
            )));
        }
        if parser.properties == 0 {
            return Err(CompileError::NoProperties);
        }
        if parser.properties > PROPERTIES_MAX {
            return Err(CompileError::TooComplex(format!(
                "expression uses too many properties ({}), max allowed properties: \
                 {PROPERTIES_MAX}",
                parser.properties
            )));
        }
        Ok(Expression {
            text: text.to_string(),
            root,
        })
    }

    /// The text it was compiled from.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the message whose properties `props` holds matches (false on any evaluation
    /// error, see the module doc).
    pub fn matches<P: Properties + ?Sized>(&self, props: &P) -> bool {
        matches!(eval(&self.root, props), Ok(Owned::Bool(true)))
    }
}

/// An evaluated value (strings borrowed from the expression or the properties).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owned<'a> {
    Bool(bool),
    Int(i64),
    Str(&'a str),
}

/// An evaluation error: the expression is false for the message.
struct EvalError;

fn eval<'a, P: Properties + ?Sized>(node: &'a Node, props: &'a P) -> Result<Owned<'a>, EvalError> {
    Ok(match node {
        Node::Property(name) => match props.get(name).map_err(|_| EvalError)? {
            Value::Bool(b) => Owned::Bool(b),
            Value::Int(i) => Owned::Int(i),
            Value::Str(s) => Owned::Str(s),
        },
        Node::Exists(name) => Owned::Bool(props.get(name).is_ok()),
        Node::Int(i) => Owned::Int(*i),
        Node::Str(s) => Owned::Str(s),
        Node::Bool(b) => Owned::Bool(*b),
        Node::Not(e) => match eval(e, props)? {
            Owned::Bool(b) => Owned::Bool(!b),
            _ => return Err(EvalError),
        },
        Node::Neg(e) => match eval(e, props)? {
            Owned::Int(i) => Owned::Int(i.wrapping_neg()),
            _ => return Err(EvalError),
        },
        Node::Binary(op @ (BinOp::Or | BinOp::And), l, r) => {
            let Owned::Bool(left) = eval(l, props)? else {
                return Err(EvalError);
            };
            // Short-circuit, as BlazingMQ's: the right side is not evaluated (nor can it
            // fail) once the left decides.
            if (*op == BinOp::Or && left) || (*op == BinOp::And && !left) {
                return Ok(Owned::Bool(left));
            }
            match eval(r, props)? {
                Owned::Bool(b) => Owned::Bool(b),
                _ => return Err(EvalError),
            }
        }
        Node::Binary(op, l, r) => {
            let (left, right) = (eval(l, props)?, eval(r, props)?);
            if let (Owned::Str(a), Owned::Str(b)) = (left, right) {
                return match op {
                    BinOp::Eq => Ok(Owned::Bool(a == b)),
                    BinOp::Ne => Ok(Owned::Bool(a != b)),
                    BinOp::Lt => Ok(Owned::Bool(a < b)),
                    BinOp::Le => Ok(Owned::Bool(a <= b)),
                    BinOp::Gt => Ok(Owned::Bool(a > b)),
                    BinOp::Ge => Ok(Owned::Bool(a >= b)),
                    _ => Err(EvalError),
                };
            }
            let (Owned::Int(a), Owned::Int(b)) = (left, right) else {
                return Err(EvalError);
            };
            match op {
                BinOp::Eq => Owned::Bool(a == b),
                BinOp::Ne => Owned::Bool(a != b),
                BinOp::Lt => Owned::Bool(a < b),
                BinOp::Le => Owned::Bool(a <= b),
                BinOp::Gt => Owned::Bool(a > b),
                BinOp::Ge => Owned::Bool(a >= b),
                BinOp::Add => Owned::Int(a.wrapping_add(b)),
                BinOp::Sub => Owned::Int(a.wrapping_sub(b)),
                BinOp::Mul => Owned::Int(a.wrapping_mul(b)),
                BinOp::Div | BinOp::Mod if b == 0 || (a == i64::MIN && b == -1) => {
                    return Err(EvalError)
                }
                BinOp::Div => Owned::Int(a / b),
                BinOp::Mod => Owned::Int(a % b),
                BinOp::Or | BinOp::And => unreachable!("handled above"),
            }
        }
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Name(String),
    Exists,
    Int(i64),
    Str(String),
    True,
    False,
    LPar,
    RPar,
    Not,
    Minus,
    Op(BinOp),
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Name(n) => write!(f, "property {n:?}"),
            Token::Exists => f.write_str("\"exists\""),
            Token::Int(i) => write!(f, "integer {i}"),
            Token::Str(s) => write!(f, "string {s:?}"),
            Token::True => f.write_str("\"true\""),
            Token::False => f.write_str("\"false\""),
            Token::LPar => f.write_str("\"(\""),
            Token::RPar => f.write_str("\")\""),
            Token::Not => f.write_str("\"!\""),
            Token::Minus => f.write_str("\"-\""),
            Token::Op(op) => f.write_str(match op {
                BinOp::Or => "\"||\"",
                BinOp::And => "\"&&\"",
                BinOp::Eq => "\"==\"",
                BinOp::Ne => "\"!=\"",
                BinOp::Lt => "\"<\"",
                BinOp::Le => "\"<=\"",
                BinOp::Gt => "\">\"",
                BinOp::Ge => "\">=\"",
                BinOp::Add => "\"+\"",
                BinOp::Sub => "\"-\"",
                BinOp::Mul => "\"*\"",
                BinOp::Div => "\"/\"",
                BinOp::Mod => "\"%\"",
            }),
        }
    }
}

/// The tokens of `text` with their byte offsets (BlazingMQ's scanner rules, longest match).
fn scan(text: &str) -> Result<Vec<(Token, usize)>, CompileError> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let syntax = |message: String, offset: usize| CompileError::Syntax { message, offset };
    while i < b.len() {
        let start = i;
        let c = b[i];
        let two = b.get(i + 1).copied();
        let token = match c {
            b' ' | b'\t' | b'\n' => {
                i += 1;
                continue;
            }
            b'a'..=b'z' | b'A'..=b'Z' => {
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'.')
                {
                    i += 1;
                }
                match &text[start..i] {
                    "true" => Token::True,
                    "false" => Token::False,
                    "exists" => Token::Exists,
                    name => Token::Name(name.to_string()),
                }
            }
            b'0'..=b'9' | b'-' if c != b'-' || two.is_some_and(|d| d.is_ascii_digit()) => {
                i += 1;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                let digits = &text[start..i];
                match digits.parse::<i64>() {
                    Ok(v) => Token::Int(v),
                    Err(_) => return Err(syntax("integer overflow".into(), start)),
                }
            }
            b'"' => {
                i += 1;
                loop {
                    match b.get(i) {
                        None => return Err(syntax("unterminated string".into(), start)),
                        Some(b'"') => break,
                        Some(b'\\') if i + 1 < b.len() => i += 2,
                        Some(b'\\') => return Err(syntax("unterminated string".into(), start)),
                        Some(_) => i += 1,
                    }
                }
                i += 1;
                Token::Str(text[start + 1..i - 1].to_string())
            }
            _ => {
                let (token, len) = match (c, two) {
                    (b'(', _) => (Token::LPar, 1),
                    (b')', _) => (Token::RPar, 1),
                    (b'|', Some(b'|')) => (Token::Op(BinOp::Or), 2),
                    (b'&', Some(b'&')) => (Token::Op(BinOp::And), 2),
                    (b'=', Some(b'=')) => (Token::Op(BinOp::Eq), 2),
                    (b'!', Some(b'=')) => (Token::Op(BinOp::Ne), 2),
                    (b'<', Some(b'=')) => (Token::Op(BinOp::Le), 2),
                    (b'>', Some(b'=')) => (Token::Op(BinOp::Ge), 2),
                    (b'<', _) => (Token::Op(BinOp::Lt), 1),
                    (b'>', _) => (Token::Op(BinOp::Gt), 1),
                    (b'!' | b'~', _) => (Token::Not, 1),
                    (b'-', _) => (Token::Minus, 1),
                    (b'+', _) => (Token::Op(BinOp::Add), 1),
                    (b'*', _) => (Token::Op(BinOp::Mul), 1),
                    (b'/', _) => (Token::Op(BinOp::Div), 1),
                    (b'%', _) => (Token::Op(BinOp::Mod), 1),
                    _ => {
                        let ch = text[start..].chars().next().unwrap_or('?');
                        return Err(syntax(format!("invalid character {ch:?}"), start));
                    }
                };
                i += len;
                token
            }
        };
        out.push((token, start));
    }
    Ok(out)
}

/// Binding power of a binary operator (higher binds tighter) and whether it chains
/// (non-associative operators do not: `a == b == c` is a syntax error, as with bison's
/// `%nonassoc`).
fn binding(op: BinOp) -> (u8, bool) {
    match op {
        BinOp::Or => (1, true),
        BinOp::And => (2, true),
        BinOp::Eq | BinOp::Ne => (3, false),
        BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => (4, false),
        BinOp::Add | BinOp::Sub => (5, true),
        BinOp::Mul | BinOp::Div | BinOp::Mod => (6, true),
    }
}

/// Binding power of the unary operators (`!`, `~`, `-`): above every binary one.
const UNARY: u8 = 7;

struct Parser {
    tokens: Vec<(Token, usize)>,
    at: usize,
    operators: usize,
    properties: usize,
    end: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at).map(|(t, _)| t)
    }

    fn offset(&self) -> usize {
        self.tokens.get(self.at).map_or(self.end, |(_, o)| *o)
    }

    fn unexpected(&self, expecting: &str) -> CompileError {
        let found = self
            .peek()
            .map_or("end of expression".to_string(), Token::to_string);
        CompileError::Syntax {
            message: format!("unexpected {found}, expecting {expecting}"),
            offset: self.offset(),
        }
    }

    /// An expression whose binary operators bind tighter than `min` (precedence climbing).
    fn expression(&mut self, min: u8) -> Result<Node, CompileError> {
        let mut left = self.operand()?;
        let mut last_nonassoc: Option<u8> = None;
        loop {
            let op = match self.peek() {
                Some(Token::Op(op)) => *op,
                Some(Token::Minus) => BinOp::Sub,
                _ => break,
            };
            let (power, chains) = binding(op);
            if power <= min {
                break;
            }
            if !chains && last_nonassoc == Some(power) {
                return Err(self.unexpected("an operator of another precedence"));
            }
            self.at += 1;
            let right = self.expression(power)?;
            self.operators += 1;
            left = combine(op, left, right);
            last_nonassoc = (!chains).then_some(power);
        }
        Ok(left)
    }

    fn operand(&mut self) -> Result<Node, CompileError> {
        let Some(token) = self.peek().cloned() else {
            return Err(self.unexpected("an operand"));
        };
        self.at += 1;
        Ok(match token {
            Token::Name(name) => {
                self.properties += 1;
                self.operators += 1;
                Node::Property(name)
            }
            Token::Exists if self.peek() == Some(&Token::LPar) => {
                self.at += 1;
                let name = match self.peek().cloned() {
                    Some(Token::Name(name)) => name,
                    Some(Token::Exists) => "exists".to_string(),
                    _ => return Err(self.unexpected("a property")),
                };
                self.at += 1;
                if self.peek() != Some(&Token::RPar) {
                    return Err(self.unexpected("\")\""));
                }
                self.at += 1;
                self.properties += 1;
                self.operators += 1;
                Node::Exists(name)
            }
            // `exists` alone is a property of that name.
            Token::Exists => {
                self.properties += 1;
                self.operators += 1;
                Node::Property("exists".into())
            }
            Token::Int(v) => Node::Int(v),
            Token::Str(s) => Node::Str(s),
            Token::True => Node::Bool(true),
            Token::False => Node::Bool(false),
            Token::Not => {
                let e = self.expression(UNARY)?;
                self.operators += 1;
                Node::Not(Box::new(e))
            }
            Token::Minus => {
                let e = self.expression(UNARY)?;
                self.operators += 1;
                Node::Neg(Box::new(e))
            }
            Token::LPar => {
                let e = self.expression(0)?;
                if self.peek() != Some(&Token::RPar) {
                    return Err(self.unexpected("\")\""));
                }
                self.at += 1;
                e
            }
            Token::RPar | Token::Op(_) => {
                self.at -= 1;
                return Err(self.unexpected("an operand"));
            }
        })
    }
}

/// `left op right`, with BlazingMQ's rewrite of a comparison with a boolean literal (`x ==
/// true` is `x`, `x == false` is `!x`, and so on).
fn combine(op: BinOp, left: Node, right: Node) -> Node {
    if matches!(op, BinOp::Eq | BinOp::Ne) {
        let negate = |n: Node| Node::Not(Box::new(n));
        let same = op == BinOp::Eq;
        match (&left, &right) {
            (Node::Bool(a), Node::Bool(b)) => return Node::Bool((a == b) == same),
            (Node::Bool(a), _) => return if *a == same { right } else { negate(right) },
            (_, Node::Bool(b)) => return if *b == same { left } else { negate(left) },
            _ => {}
        }
    }
    Node::Binary(op, Box::new(left), Box::new(right))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Props(HashMap<&'static str, Result<Value<'static>, Unreadable>>);

    impl Properties for Props {
        fn get(&self, name: &str) -> Result<Value<'_>, Unreadable> {
            self.0
                .get(name)
                .copied()
                .unwrap_or(Err(Unreadable::Missing))
        }
    }

    fn props() -> Props {
        Props(HashMap::from([
            ("seq", Ok(Value::Int(50))),
            ("name", Ok(Value::Str("orders"))),
            ("urgent", Ok(Value::Bool(true))),
            ("blob", Err(Unreadable::Type)),
            ("x.y_z", Ok(Value::Int(-3))),
        ]))
    }

    fn eval_str(text: &str) -> bool {
        Expression::compile(text)
            .unwrap_or_else(|e| panic!("{text}: {e}"))
            .matches(&props())
    }

    #[test]
    fn comparisons_and_logic_follow_blazingmqs_precedence() {
        for (text, want) in [
            ("seq >= 50", true),
            ("seq > 50", false),
            ("seq == 50 && name == \"orders\"", true),
            ("seq < 10 || name != \"orders\"", false),
            ("seq < 10 || seq > 20 && urgent", true),
            ("(seq < 10 || seq > 20) && !urgent", false),
            ("seq + 10 * 2 == 70", true),
            ("(seq + 10) * 2 == 120", true),
            ("seq % 7 == 1 && seq / 7 == 7", true),
            ("-seq == -50", true),
            ("x.y_z < 0", true),
            ("urgent", true),
            ("urgent == false", false),
            ("urgent != false", true),
            ("~urgent", false),
            ("exists(seq) && !exists(missing)", true),
            ("name < \"p\"", true),
        ] {
            assert_eq!(eval_str(text), want, "{text}");
        }
    }

    #[test]
    fn evaluation_errors_make_the_expression_false() {
        // Missing property, binary property, type mismatch, division by zero, a non-boolean
        // result: false (BlazingMQ's evaluator sets an error and answers false).
        for text in [
            "missing == 1",
            "blob == 1",
            "name == 1",
            "seq / 0 == 1",
            "seq + 1",
            "urgent + 1 == 2",
            "!seq",
        ] {
            assert!(!eval_str(text), "{text}");
        }
        // Short-circuit: the failing side is not evaluated once the left decides.
        assert!(eval_str("urgent || missing == 1"));
    }

    #[test]
    fn invalid_expressions_are_refused_with_blazingmqs_codes() {
        let code = |t: &str| Expression::compile(t).unwrap_err().code();
        assert_eq!(code("seq >"), -100);
        assert_eq!(code("seq = 1"), -100, "a single = is an invalid character");
        assert_eq!(code("seq == 1 == 1"), -100, "== does not chain");
        assert_eq!(code("a < b < c"), -100, "orderings do not chain");
        assert_eq!(
            code("seq-1 > 0"),
            -100,
            "-1 is one token, as BlazingMQ scans it"
        );
        assert_eq!(code("(seq > 1"), -100);
        assert_eq!(code("\"open"), -100);
        assert_eq!(code("seq > 99999999999999999999"), -100, "integer overflow");
        assert_eq!(code(""), -100);
        assert_eq!(code("val | true"), -100);
        assert_eq!(code("val <> 42"), -100);
        assert_eq!(code("i_0 != 9223372036854775808"), -100, "past i64");
        assert_eq!(code("1 == 1"), -101);
        assert_eq!(code("true && true"), -101);
        assert_eq!(
            code("a > 1 && b > 2 && c > 3 && d > 4"),
            -102,
            "4 properties, 4 comparisons and 3 ands are 11 operators"
        );
        assert_eq!(code(&format!("s == \"{}\"", "x".repeat(130))), -103);
        let e = Expression::compile("seq >= && 1").unwrap_err();
        assert_eq!(e.kind(), "SYNTAX");
        assert!(e.to_string().contains("offset 7"), "{e}");
        assert!(Expression::compile("seq - 1 > 0").is_ok());
        assert!(
            Expression::compile("exists").is_ok(),
            "a property named exists"
        );
        let exists_42 = Props(HashMap::from([("exists", Ok(Value::Int(42)))]));
        assert!(Expression::compile("exists == 42")
            .unwrap()
            .matches(&exists_42));
        assert!(Expression::compile("exists(exists)")
            .unwrap()
            .matches(&exists_42));
    }

    #[test]
    fn our_typed_properties_are_read_by_type() {
        use crate::client::{Property, PropertyType};
        let p = |k: &str, v: &str, t: PropertyType| Property {
            key: k.into(),
            value: v.into(),
            value_type: t as i32,
        };
        let props = [
            p("seq", "51", PropertyType::Int32),
            p("text", "51", PropertyType::String),
            p("flag", "true", PropertyType::Bool),
            p("bytes", "00ff", PropertyType::Binary),
        ];
        let m = |t: &str| Expression::compile(t).unwrap().matches(&props[..]);
        assert!(m("seq >= 50 && flag"));
        assert!(m("text == \"51\""));
        assert!(!m("text >= 50"), "a string is no integer");
        assert!(!m("bytes == \"00ff\""), "binary cannot be compared");
    }
}
