"""services/kvstore"""
