package main

import (
	"errors"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// oneLine folds an error message onto one line, each distinct part once.
// pgx's connect error lists every address it tried on a line of its own
// ("failed to connect to ...:\n\taddr (host): cause\n\taddr (host): cause"),
// and under sslmode=prefer one address fails twice with the same cause (with
// TLS, then without): the exit line and the log lines show it once.
func oneLine(msg string) string {
	var parts []string
	for _, p := range strings.Split(msg, "\n") {
		p = strings.TrimSpace(strings.ReplaceAll(p, "\t", " "))
		if p != "" && !slices.Contains(parts, p) {
			parts = append(parts, p)
		}
	}
	var b strings.Builder
	for i, p := range parts {
		if i > 0 {
			if strings.HasSuffix(parts[i-1], ":") {
				b.WriteString(" ")
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(p)
	}
	return b.String()
}

// errLine is how the CLI shows an error, on its exit line and in a log
// line: oneLine of its message, with the server's answer first (causeFirst).
func errLine(err error) string { return oneLine(causeFirst(err)) }

// causeFirst returns err's message with the attempts of pgx's connect error
// reordered so that those the server answered (a *pgconn.PgError: a wrong
// password, a missing role or database) come before those it did not. With
// sslmode=prefer (the default), pgx tries TLS first and then without: a
// server without TLS refuses the first ("tls error: server refused TLS
// connection") and rejects the password of the second, and the refusal,
// which is not the problem, would lead.
func causeFirst(err error) string {
	msg := err.Error()
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return msg
	}
	joined, ok := ce.Unwrap().(interface{ Unwrap() []error })
	if !ok {
		return msg
	}
	var answered, others []string
	for _, attempt := range joined.Unwrap() {
		var pgErr *pgconn.PgError
		if errors.As(attempt, &pgErr) {
			answered = append(answered, attempt.Error())
		} else {
			others = append(others, attempt.Error())
		}
	}
	if len(answered) == 0 || len(others) == 0 {
		return msg
	}
	old := ce.Error()
	prefix, _, ok := strings.Cut(old, "\n\t")
	if !ok {
		return msg
	}
	return strings.Replace(msg, old, prefix+"\n\t"+strings.Join(append(answered, others...), "\n\t"), 1)
}

// oneLineErrors is a zapcore.Core that writes every error field as
// oneLine of its message, so that a console log line has no "\n\t" and no
// repeated cause. It wraps the process's own core, which samples nothing.
type oneLineErrors struct{ zapcore.Core }

func (c oneLineErrors) With(fields []zapcore.Field) zapcore.Core {
	return oneLineErrors{c.Core.With(oneLineFields(fields))}
}

func (c oneLineErrors) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c oneLineErrors) Write(e zapcore.Entry, fields []zapcore.Field) error {
	return c.Core.Write(e, oneLineFields(fields))
}

// oneLineFields returns fields with each error field replaced by a string
// field of the same key: oneLine of the error's message.
func oneLineFields(fields []zapcore.Field) []zapcore.Field {
	var out []zapcore.Field
	for i, f := range fields {
		err, ok := f.Interface.(error)
		if f.Type != zapcore.ErrorType || !ok {
			continue
		}
		if out == nil {
			out = slices.Clone(fields)
		}
		out[i] = zap.String(f.Key, errLine(err))
	}
	if out == nil {
		return fields
	}
	return out
}
