"""See DESIGN.md section 8."""
