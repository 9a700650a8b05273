package relay

import (
	"context"
	"slices"
	"strings"

	"github.com/stagedrain/stagedrain/relay/internal/pgschema"
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
	if err := pgschema.CheckSchemaList(items); err != nil {
		return fieldErr("Schemas", "%s", err)
	}
	return nil
}

// isSchemaPattern reports whether item of a schema list is a pattern (it
// has a '*') rather than a name.
func isSchemaPattern(item string) bool { return pgschema.IsSchemaPattern(item) }

// listSchemas returns the schemas of the database that items (a valid
// list) name, sorted bytewise; with table set, only those that hold it.
// relay/admin's ListSchemas is the same, for admin tools.
func listSchemas(ctx context.Context, q pgschema.Querier, items []string, table string) ([]string, error) {
	return pgschema.ListSchemas(ctx, q, items, table)
}

// matchSchemaPattern reports whether a pattern of a schema list matches
// name as pgschema.ListSchemas's LIKE does: '*' matches any run of
// characters, every other character itself.
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
	return slices.DeleteFunc(slices.Clone(items), isSchemaPattern)
}
