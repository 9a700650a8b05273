package relay

import (
	"context"
	"fmt"
	"slices"
	"strings"
)

// A relay drains one schema (Config.Schema) or many (Config.Schemas). Many
// are named by a list whose items are schema names or patterns: a pattern
// has a '*', which matches any run of characters (tenant_* matches
// tenant_1 and tenant_acme); every other character matches itself ('_' and
// '%' included, unlike in SQL's LIKE).

// ParseSchemas splits a comma list of schema names and patterns (the value
// of stagedrain's --schemas), trimming spaces around each item. An empty
// list, an empty item, an item PostgreSQL could not name (over 63 bytes, a
// NUL byte) and a repeated item are refused, as a *FieldError of field
// Schemas.
func ParseSchemas(list string) ([]string, error) {
	items := strings.Split(list, ",")
	for i, s := range items {
		items[i] = strings.TrimSpace(s)
	}
	if err := validateSchemas(items); err != nil {
		return nil, err
	}
	return items, nil
}

// validateSchemas checks Config.Schemas.
func validateSchemas(items []string) error {
	if len(items) == 0 {
		return fieldErr("Schemas", "must name at least one schema or pattern")
	}
	seen := make(map[string]bool, len(items))
	for _, s := range items {
		switch {
		case s == "":
			return fieldErr("Schemas", "must not hold an empty item (a doubled or trailing comma?)")
		case len(s) > 63:
			return fieldErr("Schemas", "item %.20q... is %d bytes: a PostgreSQL name has at most 63", s, len(s))
		case strings.IndexByte(s, 0) >= 0:
			return fieldErr("Schemas", "must not contain a NUL byte")
		case strings.ContainsRune(s, ','):
			return fieldErr("Schemas", "item %q must not contain a comma", s)
		case seen[s]:
			return fieldErr("Schemas", "names %q twice", s)
		}
		seen[s] = true
	}
	return nil
}

// IsSchemaPattern reports whether item of a schema list is a pattern (it
// has a '*') rather than a name.
func IsSchemaPattern(item string) bool { return strings.Contains(item, "*") }

// splitSchemas sorts the items of a schema list into names and LIKE
// patterns (with '\' as LIKE's escape).
func splitSchemas(items []string) (names, like []string) {
	esc := strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`, `*`, `%`)
	for _, s := range items {
		if IsSchemaPattern(s) {
			like = append(like, esc.Replace(s))
		} else {
			names = append(names, s)
		}
	}
	return names, like
}

// listSchemasSQL finds the schemas that a list names: $1 the names, $2 the
// LIKE patterns; $3, when not empty, a table the schema must hold (an
// ordinary or partitioned table). A pattern never matches PostgreSQL's own
// schemas (pg_*, information_schema); a name may. Sorted bytewise, so that
// every relay sees the same order.
const listSchemasSQL = `SELECT n.nspname::text FROM pg_namespace n
	WHERE (n.nspname = ANY($1::text[])
		OR (n.nspname LIKE ANY($2::text[]) AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema'))
	AND ($3 = '' OR EXISTS (SELECT FROM pg_class c
		WHERE c.relnamespace = n.oid AND c.relname = $3 AND c.relkind IN ('r', 'p')))
	ORDER BY n.nspname COLLATE "C"`

// ListSchemas returns the schemas of the database that items (names and
// patterns, as ParseSchemas returns them) name, sorted bytewise. With
// table set (such as "staged_jobs"), only schemas that hold a table of
// that name; with table "", every schema that exists. A name that matches
// no schema is left out, not an error: the caller says what it needs of it.
func ListSchemas(ctx context.Context, db DB, items []string, table string) ([]string, error) {
	if err := validateSchemas(items); err != nil {
		return nil, err
	}
	names, like := splitSchemas(items)
	rows, err := db.Query(ctx, listSchemasSQL, names, like, table)
	if err != nil {
		return nil, fmt.Errorf("list schemas: %w", err)
	}
	defer rows.Close()
	var found []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, fmt.Errorf("list schemas: %w", err)
		}
		found = append(found, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list schemas: %w", err)
	}
	return found, nil
}

// matchSchemaPattern reports whether a pattern of a schema list matches
// name as listSchemasSQL's LIKE does: '*' matches any run of characters,
// every other character itself.
func matchSchemaPattern(pattern, name string) bool {
	parts := strings.Split(pattern, "*")
	if !strings.HasPrefix(name, parts[0]) {
		return false
	}
	name = name[len(parts[0]):]
	last := parts[len(parts)-1]
	for _, p := range parts[1 : len(parts)-1] {
		i := strings.Index(name, p)
		if i < 0 {
			return false
		}
		name = name[i+len(p):]
	}
	return len(parts) > 1 && strings.HasSuffix(name, last) || len(parts) == 1 && name == ""
}

// schemaNames returns the items of a list that are names, not patterns.
func schemaNames(items []string) []string {
	return slices.DeleteFunc(slices.Clone(items), IsSchemaPattern)
}
