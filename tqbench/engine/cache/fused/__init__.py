"""fused"""
